"""make demo's closing tables from its stages' summaries (no jobs run here)."""

from __future__ import annotations

import pathlib

from demo import budget, tables


def stage(name: str, **figures) -> dict:
    return {"stage": name, "seconds": 1.0} | figures


EV = {"users": 300, "ranker_full_ndcg10": 0.041, "ranker_full_hr10": 0.08}
EV |= {"uncompressed_full_ndcg10": 0.04, "uncompressed_full_hr10": 0.079}
EV |= {"most_popular_full_ndcg10": 0.02, "most_popular_full_hr10": 0.04}
EV |= {"item_prior_full_ndcg10": 0.06, "item_prior_full_hr10": 0.11}
EV |= {"ranker_prior_full_ndcg10": 0.072, "ranker_prior_full_hr10": 0.13, "fusion_weight": 5.0}
BUILD = {"users": 610, "tokens": 26415, "state_bytes": 1, "full_kv_bytes": 128}
BUILD |= {"ratio": 0.0078, "bytes_per_user": 3.0}
LOAD = {"concurrency": 8, "requests": 10, "candidate_scores_per_s": 5000.0}
LOAD |= {"p50_ms": 10, "p99_ms": 20, "errors": 0}


def test_the_demo_tables_show_the_prior_the_served_score_and_the_full_recipe():
    stages = [stage("build states", **BUILD), stage("evaluate", **EV), stage("serve", load=LOAD)]
    md = tables(stages)
    assert "| full-catalog, 300 test users | NDCG@10 | HR@10 |" in md
    assert "| ranker, fp16 KV | 0.0400 | 0.0790 |" in md
    assert "| ranker from the stored CollectiveKV states | 0.0410 | 0.0800 |" in md
    assert "| item-to-item prior alone | 0.0600 | 0.1100 |" in md
    assert "| **served**: states + prior (weight 5.0) | 0.0720 | 0.1300 |" in md
    assert "| **total** | **3.0** |" in md
    ref = {"recipe": "configs/ml-latest-small.yaml", "date": "2026-12-03"}
    ref |= {"ranker_full_ndcg10": 0.045, "ranker_prior_full_ndcg10": 0.078}
    ref |= {"item_prior_full_ndcg10": 0.0745, "most_popular_full_ndcg10": 0.0189}
    ref |= {"target_ndcg10": 0.07, "sasrec_ndcg10": 0.059}
    md = tables(stages, ref)
    assert "full recipe (configs/ml-latest-small.yaml, 2026-12-03) NDCG@10 |" in md
    assert "| **served**: states + prior (weight 5.0) | 0.0720 | 0.1300 | 0.0780 |" in md
    assert "| ranker from the stored CollectiveKV states | 0.0410 | 0.0800 | |" in md
    assert "quality target NDCG@10 0.07, SASRec 0.059" in md
    # without a prior the rows are left out, not printed empty
    plain = {k: v for k, v in EV.items() if "prior" not in k and k != "fusion_weight"}
    md = tables(
        [stage("build states", **BUILD), stage("evaluate", **plain), stage("serve", load=LOAD)]
    )
    assert "prior" not in md


def test_the_demo_states_its_budget_from_its_recipe():
    recipe = pathlib.Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    got = budget(str(recipe))
    assert got["train_epochs"] and got["kv_max_steps"] and got["test_users"]
