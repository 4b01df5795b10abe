"""fit_item_prior and evaluate --item-prior on the tiny dataset: the prior fitted on training
histories, picked on validation, published, read back, and fused with a trained ranker."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from artifacts import storage
from artifacts.data import user_sequences
from artifacts.prior import read_prior
from models.item_prior import FUSION_WEIGHTS
from models.metrics import ranks_from_scores
from pipelines import evaluate, fit_item_prior
from pipelines.common.scoring import ScoreUsers
from tests.tiny import run_json

GRID = ["--l2", "1,50", "--recent", "1,3", "--decay", "0.5,1", "--neighbours", "8"]


def fused_evaluation(capsys, ds: str, out: str, ranker_args: list[str]):
    """Fit the tiny prior, then evaluate the ranker named by ``ranker_args`` fused with it:
    (fit_item_prior's summary, evaluate's summary, its metrics.json)."""
    prior = run_json(capsys, fit_item_prior.main, ["--dataset-uri", ds, "--out", out, *GRID])
    s = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--out", out, *ranker_args]
        + ["--item-prior", prior["out"], "--actors", "1"],
    )
    return prior, s, json.loads(storage.read_file(s["report"], "metrics.json"))


def test_the_prior_is_fitted_picked_on_validation_and_published(tiny, capsys):
    ds, out = tiny["dataset"], tiny["out"]
    argv = ["--dataset-uri", ds, "--out", out, *GRID, "--kind", "next,ease"]
    s = run_json(capsys, fit_item_prior.main, argv)
    marker = storage.read_marker(s["out"])
    grid = marker["grid"]
    assert len(grid) == s["configs_tried"] == 2 * 2 * 2 * 2  # kind x l2 x recent x decay
    assert {r["kind"] for r in grid} == {"next", "ease"}
    best = max(grid, key=lambda r: r["val_ndcg10"])
    keys = ("kind", "l2", "recent", "decay")
    assert {k: s[k] for k in keys} == {k: best[k] for k in keys}
    assert s["val_ndcg10"] == pytest.approx(best["val_ndcg10"], abs=1e-4)
    # each tiny user walks one genre in order, so the item after the last one is what its
    # neighbours predict: far above what most-popular gets from the same histories
    seqs = user_sequences(ds)
    counts = np.bincount(np.concatenate(seqs["hist"].to_list()), minlength=s["items"])
    pop_hits = np.mean(
        [v in np.argsort(-counts)[:10] for v in seqs["valid"].to_list()]
    )  # HR@10 of most-popular, history not even excluded
    assert s["val_hr10"] > pop_hits and s["val_ndcg10"] > 0.3
    prior, m = read_prior(s["out"], s["items"])
    assert prior.cfg.to_dict() == m["config"] and prior.index.shape == (s["items"], 8)
    with pytest.raises(fit_item_prior.InputError, match="fitted on 60 items, not 61"):
        read_prior(s["out"], 61)


def test_a_bad_prior_option_is_refused_before_anything_is_fitted(tiny, capsys):
    ds, out = tiny["dataset"], tiny["out"]
    rc = fit_item_prior.main(["--dataset-uri", ds, "--out", out, "--decay", "0.5,1.5"])
    assert rc == 2 and "decay must be in (0, 1], got 1.5" in capsys.readouterr().err
    rc = fit_item_prior.main(["--dataset-uri", ds, "--out", out, "--kind", "next,svd"])
    assert rc == 2 and "prior kinds must be some of next, ease; got ['next', 'svd']" in (
        capsys.readouterr().err
    )
    with pytest.raises(
        fit_item_prior.InputError, match=r"must be some of next, ease; got \['svd'\]"
    ):
        fit_item_prior.fit_item_prior(ds, out, l2s=[1.0], neighbours=8, kinds=["svd"])
    assert not storage.exists(storage.join(out, "item_priors"))


def test_evaluate_fuses_the_prior_with_the_ranker_at_the_weight_validation_picks(
    tiny_trained, tmp_path, capsys
):
    ds, out, base = tiny_trained["dataset"], str(tmp_path / "out"), tiny_trained["base"]
    prior, s, report = fused_evaluation(capsys, ds, out, ["--checkpoint", base["checkpoint"]])
    assert set(report["metrics"]) == {"ranker", "item_prior", "ranker_prior", "most_popular"}
    fusion = report["metrics"]["ranker_prior"]["fusion"]
    curve = fusion["val_ndcg10_by_weight"]
    assert list(curve) == [str(w) for w in FUSION_WEIGHTS]
    assert fusion["weight"] in FUSION_WEIGHTS and curve[str(fusion["weight"])] == max(
        curve.values()
    )
    for m in ("item_prior", "ranker_prior"):
        assert 0 <= s[f"{m}_full_ndcg10"] <= s[f"{m}_full_hr10"] <= 1
    from models.errors import InputError
    from services.settings import ServeSettings

    with pytest.raises(InputError, match="evaluated a checkpoint, not stored states"):
        ServeSettings(manifest_uri=s["report"]).pinned()

    # the actor itself: at weight 0 the fused ranks are the ranker's own, and the prior's
    # ranks are its scores' ranks over the catalog minus the user's input
    users = evaluate.eval_users(ds, None, 0)
    batch = {c: np.array(users[c].to_list(), dtype=object) for c in users.columns}
    batch["user_id"], batch["test"] = users["user_id"].to_numpy(), users["test"].to_numpy()
    fused = evaluate_prior_actor(base["checkpoint"], prior["out"])(batch)
    ranker = ScoreUsers(base["checkpoint"], None, 1)(batch)
    np.testing.assert_array_equal(fused["fused_full_rank_0"], ranker["full_rank"])
    np.testing.assert_array_equal(fused["fused_sampled_rank_0"], ranker["sampled_rank"])
    p, _ = read_prior(prior["out"])
    inputs = [torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in batch["input"]]
    expected = ranks_from_scores(p.scores(inputs), torch.tensor(batch["test"]), inputs)
    np.testing.assert_array_equal(fused["prior_full_rank"], expected.numpy())


def evaluate_prior_actor(checkpoint: str, prior: str):
    from pipelines.common.scoring import PriorFusionRanks

    return PriorFusionRanks(checkpoint, None, 1, False, prior)


def test_evaluate_fuses_the_prior_with_the_stored_states_as_serving_does(
    tiny_trained, tmp_path, capsys
):
    import polars as pl

    from artifacts import states
    from pipelines.common.scoring import PriorFusionRanks

    ds, out, built = tiny_trained["dataset"], str(tmp_path / "out"), tiny_trained["states"]
    prior, s, report = fused_evaluation(capsys, ds, out, ["--user-states", built["user_states"]])
    assert set(report["metrics"]) == {
        "ranker",
        "uncompressed",
        "item_prior",
        "ranker_prior",
        "most_popular",
    }
    # the actor on the stored states: at weight 0 it ranks exactly as evaluate's states ranker
    manifest, table = states.read_states(built["user_states"])
    users = evaluate.eval_users(ds, None, 0).join(pl.from_arrow(table), on="user_id")
    batch = {c: users[c].to_numpy() for c in ("user_id", "test")}
    batch |= {
        c: np.array(users[c].to_list(), dtype=object) for c in users.columns if c not in batch
    }
    ck = manifest["checkpoint"]
    fused = PriorFusionRanks(ck, None, 1, True, prior["out"])(batch)
    ranker = ScoreUsers(ck, None, 1, True)(batch)
    np.testing.assert_array_equal(fused["fused_full_rank_0"], ranker["full_rank"])

    # the report is what Serve loads: the states, the prior and the weight it measured
    from models.errors import InputError
    from services.settings import ServeSettings

    served = ServeSettings(manifest_uri=s["report"]).pinned()
    assert served.manifest_uri == storage.pinned(built["user_states"])
    assert served.item_prior_weight == s["fusion_weight"]
    assert served.item_prior_uri == (storage.pinned(prior["out"]) if s["fusion_weight"] else None)
    assert served.resolved_store_uri() == ServeSettings(built["user_states"]).resolved_store_uri()
    with pytest.raises(InputError, match="give one or the other"):
        ServeSettings(s["report"], item_prior_uri=prior["out"], item_prior_weight=1.0).pinned()
