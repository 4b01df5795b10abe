"""make demo's closing tables from its stages' summaries (no jobs run here)."""

from __future__ import annotations

from demo import tables


def stage(name: str, **figures) -> dict:
    return {"stage": name, "seconds": 1.0} | figures


def test_the_demo_tables_show_the_prior_and_the_served_fused_score():
    ev = {"ranker_full_ndcg10": 0.04, "ranker_full_hr10": 0.08, "most_popular_full_ndcg10": 0.02}
    ev |= {"most_popular_full_hr10": 0.04, "item_prior_full_ndcg10": 0.06}
    ev |= {"item_prior_full_hr10": 0.11, "ranker_prior_full_ndcg10": 0.07}
    ev |= {"ranker_prior_full_hr10": 0.12, "fusion_weight": 2.0}
    evs = {"ranker_full_ndcg10": 0.041, "ranker_full_hr10": 0.08, "fusion_weight": 5.0}
    evs |= {"ranker_prior_full_ndcg10": 0.072, "ranker_prior_full_hr10": 0.13}
    build = {"users": 610, "tokens": 26415, "state_bytes": 1, "full_kv_bytes": 128}
    build |= {"ratio": 0.0078, "bytes_per_user": 3.0}
    load = {"concurrency": 8, "requests": 10, "candidate_scores_per_s": 5000.0}
    load |= {"p50_ms": 10, "p99_ms": 20, "errors": 0}
    md = tables(
        [
            stage("evaluate", **ev),
            stage("build states", **build),
            stage("evaluate states", **evs),
            stage("serve", load=load),
        ]
    )
    assert "| item-to-item prior alone | 0.0600 | 0.1100 |" in md
    assert "| text ranker + prior (weight 2.0) | 0.0700 | 0.1200 |" in md
    assert "| stored states + prior (weight 5.0): served | 0.0720 | 0.1300 |" in md
    assert "| **total** | **4.0** |" in md
    # without a prior the rows are left out, not printed empty
    plain = tables(
        [
            stage("evaluate", **{k: v for k, v in ev.items() if "prior" not in k}),
            stage("build states", **build),
            stage("evaluate states", ranker_full_ndcg10=0.04, ranker_full_hr10=0.08),
            stage("serve", load=load),
        ]
    )
    assert "prior" not in plain
