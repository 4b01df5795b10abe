"""fit_item_prior and evaluate --item-prior on the tiny dataset: the prior fitted on training
histories, picked on validation, published, read back, and fused with a trained ranker."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from artifacts import storage
from artifacts.data import user_sequences
from artifacts.prior import read_prior
from models.item_prior import FUSION_WEIGHTS
from models.metrics import ranks_from_scores
from pipelines import evaluate, fit_item_prior
from pipelines.common.scoring import ScoreUsers
from tests.tiny import logged_warnings, run_json

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


def publish_genre_vectors(ds: str, out: str) -> str:
    """The tiny catalog's item vectors as the default encoder would publish them under
    ``out``, each item's vector its genre (one-hot): what a text encoder would group."""
    import pyarrow as pa

    from artifacts.data import default_vectors_uri
    from tests.tiny import GENRES, N_ITEMS

    items = pl.from_arrow(storage.read_table(ds, "items.parquet"))
    vids, ids = items["vid"].to_numpy(), items["item_id"].to_numpy()
    vec = np.eye(len(GENRES), dtype=np.float16)[ids % len(GENRES)]
    target = default_vectors_uri(out, "tiny")
    pub = storage.Publication(target)
    table = pa.table({"vid": pa.array(vids, pa.int32()), "vector": list(vec)})
    pub.put_table("vectors.parquet", table)
    pub.publish({"kind": "item_vectors", "dim": len(GENRES), "items": N_ITEMS})
    return target


def test_the_prior_is_fitted_picked_on_validation_and_published(tiny, capsys):
    ds, out = tiny["dataset"], tiny["out"]
    argv = ["--dataset-uri", ds, "--out", out, *GRID, "--kind", "next,ease"]
    with logged_warnings("kvrank.fit_item_prior") as warned:
        s = run_json(capsys, fit_item_prior.main, argv)
    # no encoder output under --out: the items no history holds keep 0, and the job says so
    never = s["items"] - len(np.unique(np.concatenate(user_sequences(ds)["hist"].to_list())))
    assert never > 0 and s["borrowed_items"] == 0
    assert warned == [
        f"no item vectors: the {never} items without a training interaction keep prior 0 "
        "(run encode_items first, or pass --vectors-uri)"
    ]
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
    # what the served score adds over the prior alone, with its standard error paired by user
    vs = fusion["vs_prior"]
    nd = {m: report["metrics"][m]["full"]["ndcg10"] for m in ("ranker_prior", "item_prior")}
    assert vs["ndcg10_diff"] == pytest.approx(nd["ranker_prior"] - nd["item_prior"])
    assert s["served_minus_prior_ndcg10"] == round(vs["ndcg10_diff"], 4) and vs["se"] >= 0
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


def test_evaluate_reports_new_items_beside_its_sample_and_the_long_tail(
    tiny_trained, tmp_path, capsys
):
    """On a dataset with held-out items, evaluate scores every model over the users whose test
    item is new (added beside the seeded sample), and over the sample by the test item's
    popularity in the training inputs; the catalog-wide figures stay the sample's."""
    from artifacts.data import held_out_vids
    from pipelines import prepare_data
    from tests.tiny import base_texts, write_catalog, write_sequences

    out = str(tmp_path / "out")
    argv = ["--dataset", "tiny", "--items", write_catalog(tmp_path, base_texts())]
    argv += ["--sequences", write_sequences(tmp_path), "--negatives", "10", "--out", out]
    prep = run_json(capsys, prepare_data.main, [*argv, "--holdout-items", "0.25"])
    assert prep["held_out_items"] == 12 and 0 < prep["new_item_test_users"] < 20, prep
    ds = prep["out"]
    vectors = publish_genre_vectors(ds, out)  # found by fit_item_prior under --out
    base = tiny_trained["base"]["checkpoint"]  # the same catalog of 60 items
    prior, s, report = fused_evaluation(
        capsys, ds, out, ["--checkpoint", base, "--max-users", "20"]
    )
    hists = user_sequences(ds)["hist"].to_list()
    never = prior["items"] - len(np.unique(np.concatenate(hists)))
    assert prior["borrowed_items"] == never >= prep["held_out_items"]
    assert storage.read_marker(prior["out"])["vectors_uri"] == storage.pinned(vectors)
    per_user = pl.from_arrow(storage.read_table(s["report"], "per_user.parquet"))
    held = held_out_vids(ds)
    tests = dict(zip(*user_sequences(ds).select("user_id", "test"), strict=True))
    new = per_user["user_id"].map_elements(lambda u: tests[u] in held, return_dtype=bool)
    assert per_user["new_item"].to_list() == new.to_list()
    assert s["users"] == report["users"] == per_user["in_sample"].sum() == 20
    # every new-item user is scored, in the sample or beside it
    assert s["new_item_users"] == report["new_items"]["users"] == prep["new_item_test_users"]
    assert per_user.height == 20 + per_user.filter(~pl.col("in_sample") & "new_item").height
    models = {"ranker", "item_prior", "ranker_prior", "most_popular"}
    assert models <= set(report["new_items"]) and {f"{m}_new_full_ndcg10" for m in models} <= set(s)
    for m in models:
        v = report["new_items"][m]
        assert 0 <= v["ndcg10"] <= v["hr10"] <= v["hr100"] <= 1 and v["ndcg10_se"] >= 0
        ranks = per_user.filter("new_item")[f"{m}_full_rank"].to_numpy()
        assert v["median_rank"] == np.median(ranks) == s[f"{m}_new_median_rank"]
    # most-popular ranks an item no input holds below every item some input does; the prior,
    # its votes borrowed from the item's genre, ranks it where that genre's users look
    assert s["most_popular_new_full_ndcg10"] == 0
    assert s["item_prior_new_median_rank"] < 20 < s["most_popular_new_median_rank"], s
    assert s["item_prior_new_full_ndcg10"] > 0
    tail = report["by_item_popularity"]
    assert tail == s["by_item_popularity"] and sum(tail["users"]) == 20
    sample = per_user.filter("in_sample")
    assert tail["bucket"][0] == "0" and tail["users"][0] == (sample["test_popularity"] == 0).sum()
    assert tail["users"][0] >= sample["new_item"].sum() > 0
    assert set(tail["ndcg10"]) == models and all(
        len(v) == len(tail["bucket"]) for v in tail["ndcg10"].values()
    )
    assert storage.read_file(s["report"], "ndcg_by_item_popularity.png")[:4] == b"\x89PNG"


def test_a_ranker_trained_complementary_to_the_prior_is_fused_at_its_learned_weight(
    tiny, ray_local, capsys, monkeypatch
):
    """train_ranker --item-prior: each user's windows read a prior refitted without their fold,
    the learned weight moves and is published with the prior's name; evaluate then fuses the
    ranker with that prior at that weight (not one picked afterwards) and refuses another."""
    from artifacts.data import item_table
    from models.errors import InputError
    from models.item_prior import ItemPrior
    from pipelines import train_ranker
    from pipelines.common import prior_offsets
    from tests.tiny import TINY_SHAPE

    # a relative --out, as `make demo` passes it (Ray Train and the actors need it made absolute)
    monkeypatch.chdir(tiny["dir"])
    ds, out = tiny["dataset"], "out"
    vectors = publish_genre_vectors(ds, out)  # the items no history holds borrow from these
    prior = run_json(capsys, fit_item_prior.main, ["--dataset-uri", ds, "--out", out, *GRID])
    assert prior["borrowed_items"] > 0
    argv = ["--dataset-uri", ds, "--out", out, "--item-input", "id", "--epochs", "2", *TINY_SHAPE]
    # a starting weight without the prior it weighs: refused by name
    assert train_ranker.main([*argv, "--prior-weight", "5"]) != 0
    assert "it needs --item-prior" in capsys.readouterr().err
    s = run_json(capsys, train_ranker.main, [*argv, "--run", "comp", "--item-prior", prior["out"]])
    marker = storage.read_marker(s["checkpoint"])
    assert marker["item_prior"] == storage.pinned(prior["out"])
    # the weight started calibrated (the prior alone at its best) and moved in training
    assert marker["prior_weight"] == s["prior_weight"] > 0 and s["prior_weight_start"] > 0
    assert s["prior_weight"] != s["prior_weight_start"]
    history = json.loads(storage.read_file(s["checkpoint"], "metrics.json"))
    assert all(h["prior_weight"] > 0 for h in history)  # each epoch's mean, as it learned
    # the offsets' priors: one per fold, each fitted without that fold's users, then the
    # published one
    seqs = user_sequences(ds)
    users = seqs.filter(seqs["hist"].list.len() >= 2)
    folds = prior_offsets.prior_folds(users["user_id"].to_numpy(), 0)
    assert np.bincount(folds).tolist() == [len(users) // 5] * 5  # 40 users: 8 per fold
    stacked = prior_offsets.load_priors(storage.join(s["checkpoint"], "train", "priors.pt"))
    published, _ = read_prior(prior["out"])
    assert stacked.index.shape[0] == 6 and stacked.prior(5).weight.equal(published.weight)
    hists = [torch.as_tensor(np.asarray(h)) for h in users["hist"].to_list()]
    refit = ItemPrior.fit(
        [h for h, f in zip(hists, folds, strict=True) if f != 3],
        *(60, published.cfg, item_table(vectors, 60)[0], 10),  # borrowing as it was published
    )
    assert stacked.prior(3).weight.equal(refit.weight) and not refit.weight.equal(published.weight)
    # evaluate fuses it at its own weight with its own prior
    ev = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--out", out, "--checkpoint", s["checkpoint"], "--actors", "1"],
    )
    report = json.loads(storage.read_file(ev["report"], "metrics.json"))
    fusion = report["metrics"]["ranker_prior"]["fusion"]
    assert fusion["learned"] and fusion["weight"] == ev["fusion_weight"] == s["prior_weight"]
    assert list(fusion["val_ndcg10_by_weight"]) == ["0.0", str(s["prior_weight"])]
    assert report["item_prior"] == marker["item_prior"]
    other = run_json(
        capsys, fit_item_prior.main, ["--dataset-uri", ds, "--out", out, "--run", "b", *GRID]
    )
    with pytest.raises(InputError, match="was trained complementary to the prior"):
        evaluate.evaluate(ds, s["checkpoint"], out, item_prior=other["out"])


def test_a_ranker_mining_negatives_from_the_prior_trains_and_names_it(tiny, ray_local, capsys):
    """train_ranker --prior-negatives: refused by name without the prior to mine from (or
    beyond --negatives); with it, the job trains through Ray Train and its checkpoint names the
    prior."""
    from pipelines import train_ranker
    from tests.tiny import TINY_SHAPE

    ds, out = tiny["dataset"], tiny["out"]
    prior = run_json(capsys, fit_item_prior.main, ["--dataset-uri", ds, "--out", out, *GRID])
    argv = ["--dataset-uri", ds, "--out", out, "--item-input", "id", "--epochs", "1", *TINY_SHAPE]
    argv += ["--negatives", "3", "--prior-negatives", "2"]
    assert train_ranker.main(argv) != 0
    assert "give its folder as --negatives-prior" in capsys.readouterr().err
    assert train_ranker.main([*argv, "--prior-negatives", "4"]) != 0
    assert "--prior-negatives must be in [0, --negatives = 3]" in capsys.readouterr().err
    s = run_json(
        capsys, train_ranker.main, [*argv, "--run", "mined", "--negatives-prior", prior["out"]]
    )
    assert s["epochs_run"] == 1
    assert storage.read_marker(s["checkpoint"])["negatives_prior"] == storage.pinned(prior["out"])
