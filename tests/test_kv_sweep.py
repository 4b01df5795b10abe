"""benchmarks.kv_sweep end to end on the tiny dataset: every row fitted, its states stored and
read back, and its ratio the closed form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import kv_sweep
from models.config import CollectiveKVConfig
from pipelines import train_kv_pool
from tests.tiny import logged_warnings


def test_sweep_rows_come_from_stored_states_at_the_closed_form_ratio(
    tiny_trained, tmp_path, capsys
):
    """The baselines and the low-rank fit, each scored; the CollectiveKV rows' fit, states and
    scores are the resumed sweep's (next test), whose fit the tiny chain made."""
    ds, out, base = tiny_trained["dataset"], str(tmp_path / "out"), tiny_trained["base"]
    path = tmp_path / "sweep.json"
    with logged_warnings("kvrank.train_kv_pool") as warned:
        kv_sweep.main(
            ["--dataset-uri", ds, "--checkpoint", base["checkpoint"], "--out", out]
            + ["--pool-sizes", "", "--low-ranks", "4", "--max-users", "20"]
            + ["--max-steps", "2", "--val-users", "8", "--sample-states", "--json", str(path)]
            + ["--lr", "0"]  # the fitted start, unchanged by the fine-tune: see the last check
            + ["--init-tokens", "150"]
        )
    result = json.loads(path.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    # per token and layer: fp16 K and V of width 32 are 128 bytes; int8 adds a scale per head;
    # low-rank R fp16 numbers
    expected = {
        "uncompressed fp16 KV": 1.0,
        "int8 KV (scale per token, head)": (2 * (32 + 2 * 2)) / 128,
        "low-rank KV, R=4": 4 * 2 / 128,
    }
    assert {m: r["ratio"] for m, r in rows.items()} == pytest.approx(expected, abs=1e-5)
    assert result["test_users"] == 20 and result["states_of"] == "sampled test users"
    assert result["complete"] is True
    # the fit drew its low-rank maps from exactly the tokens asked for, and a low-rank map has
    # no pool to be told is thin
    assert result["init_tokens"] == rows["low-rank KV, R=4"]["init_tokens"] == 150
    assert not [w for w in warned if "k-means fitted" in w]
    for r in rows.values():
        assert 0 <= r["ndcg10"] <= r["hr10"] <= 1
        assert r["ndcg10_gap"] == pytest.approx(
            r["ndcg10"] - rows["uncompressed fp16 KV"]["ndcg10"], abs=1e-5
        )
    assert rows["uncompressed fp16 KV"]["ndcg10_gap_se"] == 0.0
    assert "| low-rank KV, R=4 |" in capsys.readouterr().out
    # a fitted row validates its starting weights before fine-tuning; at lr 0 the fine-tune
    # leaves them as they were, so the epoch validates exactly as the start did
    low = rows["low-rank KV, R=4"]
    assert 0 <= low["start_val_ndcg10"] == low["val_ndcg10"] <= 1


def test_a_sweep_stopped_midway_keeps_the_rows_it_finished(
    tiny_trained, tmp_path, capsys, monkeypatch
):
    ds, out, base = tiny_trained["dataset"], str(tmp_path / "out"), tiny_trained["base"]
    path = tmp_path / "sweep.json"

    def stopped(*args, **kwargs):
        raise RuntimeError("the session ran out")

    monkeypatch.setattr(train_kv_pool, "fit", stopped)
    with pytest.raises(RuntimeError, match="ran out"):
        kv_sweep.main(
            ["--dataset-uri", ds, "--checkpoint", base["checkpoint"], "--out", out]
            + ["--configs", "16:2", "--low-ranks", "", "--max-users", "20", "--json", str(path)]
        )
    result = json.loads(path.read_text())
    # the two baselines scored before the first fit are on disk, marked incomplete
    assert result["complete"] is False
    assert [r["method"] for r in result["rows"]] == [
        "uncompressed fp16 KV",
        "int8 KV (scale per token, head)",
    ]
    assert result["rows"][0]["ndcg_vs_uncompressed"] == 1.0
    monkeypatch.undo()

    # run again without --resume, it refuses before any work and the rows stay on disk
    args = ["--dataset-uri", ds, "--checkpoint", base["checkpoint"], "--out", out]
    args += ["--configs", "16:2", "--low-ranks", "", "--max-users", "20", "--json", str(path)]
    stored = path.read_text()
    with pytest.raises(SystemExit, match="did not finish: give --resume"):
        kv_sweep.main(args)
    # resumed with other settings, its rows would not compare: it says which setting differs
    with pytest.raises(SystemExit, match="test_users: 20 there, 10 now"):
        kv_sweep.main(args[:-4] + ["--max-users", "10", "--json", str(path), "--resume"])
    # a checkpoint that does not score the stored uncompressed row is another ranker
    tampered = json.loads(stored)
    tampered["rows"][0]["ndcg10"] += 0.01
    path.write_text(json.dumps(tampered))
    with pytest.raises(SystemExit, match="not the ranker those rows were fitted to"):
        kv_sweep.main(args + ["--resume"])
    assert json.loads(path.read_text()) == tampered  # a refused resume writes nothing
    path.write_text(stored)

    # resumed: the uncompressed row is scored again (to check it), int8 is not, and only the
    # missing fit runs; the stored rows come through unchanged. The fit it asks for (M=16,
    # d_u=2 on the tiny chain's base) is the one the tiny chain made already: it is handed over
    # instead of being fitted twice, and the sweep builds and scores its states as any other.
    scored, fits = [], []
    ranks_for = kv_sweep.ranks_for
    monkeypatch.setattr(
        kv_sweep, "ranks_for", lambda *a, **kw: scored.append(1) or ranks_for(*a, **kw)
    )

    def the_chains_fit(dataset_uri, checkpoint, out, *, run, ckv, **kw):
        fits.append((checkpoint, ckv))
        return tiny_trained["fit"]

    monkeypatch.setattr(train_kv_pool, "fit", the_chains_fit)
    kv_sweep.main(args + ["--resume"])
    resumed = json.loads(path.read_text())
    assert resumed["complete"] is True and resumed["resumed_rows"] == 2
    assert resumed["rows"][:2] == result["rows"]
    assert [r["method"] for r in resumed["rows"][2:]] == ["CollectiveKV M=16 d_u=2"]
    assert fits == [(base["checkpoint"], CollectiveKVConfig(pool_size=16, user_dim=2))]
    assert len(scored) == 2  # uncompressed (the check) + the new row
    # its states were built and read back: two uint16 indices and 2 d_u fp16 user numbers a
    # token and layer against 128 bytes of fp16 K and V
    ckv = resumed["rows"][2]
    assert ckv["ratio"] == pytest.approx((2 * 2 + 2 * 2 * 2) / 128, abs=1e-5)
    assert 0 < ckv["router_use"] <= 1 and ckv["collapsed"] == []
    assert 0 <= ckv["ndcg10"] <= ckv["hr10"] <= 1
    assert resumed["seconds"] >= result["seconds"]


def test_the_paired_error_of_a_gap_is_smaller_when_rows_share_their_users_noise():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 40, size=1000)
    # the same users, one rank better for a tenth of them: a small gap over large per-user noise
    row = np.where(rng.random(1000) < 0.1, np.maximum(base - 1, 0), base)
    e = kv_sweep.standard_errors(row, base)
    per_user = kv_sweep.user_ndcg(row)
    assert e["ndcg10_se"] == pytest.approx(per_user.std(ddof=1) / np.sqrt(1000), abs=1e-5)
    gap = per_user - kv_sweep.user_ndcg(base)
    assert e["ndcg10_gap"] == pytest.approx(gap.mean(), abs=1e-5) and e["ndcg10_gap"] > 0
    assert e["ndcg10_gap_se"] == pytest.approx(gap.std(ddof=1) / np.sqrt(1000), abs=1e-5)
    assert 0 < e["ndcg10_gap_se"] < e["ndcg10_se"] / 3
    assert kv_sweep.standard_errors(base, base)["ndcg10_gap_se"] == 0.0
    with pytest.raises(ValueError, match="999 users' ranks against 1000"):
        kv_sweep.standard_errors(row[:999], base)


def test_a_thin_pool_is_told_what_would_fill_it():
    from pipelines.train_kv_pool import thin_pool_advice

    assert thin_pool_advice(1024, 50_000, 50_000) is None  # 48.8 an entry: enough
    # the tokens asked for came back: more of them would fill the pool
    assert thin_pool_advice(4096, 50_000, 50_000) == (
        "k-means fitted 4096 pool entries to 50000 tokens (12.2 an entry): "
        "give --init-tokens 81920 or more, or a smaller --pool-size"
    )
    # fewer came back than asked (ml-latest-small's e3 holds 26,415): only a smaller pool helps
    assert thin_pool_advice(4096, 26_415, 50_000) == (
        "k-means fitted 4096 pool entries to 26415 tokens (6.4 an entry): "
        "the dataset has no more cached tokens, give --pool-size 1320 or less"
    )
    # --init-users capped the users (asked 0): more tokens may exist, so ask for them
    assert "give --init-tokens 81920" in thin_pool_advice(4096, 26_415, 0)


def test_auto_pool_size_is_the_largest_the_tokens_fill():
    import argparse

    from pipelines import train_kv_pool as t

    # 20 tokens an entry: ml-latest-small's 26,415 cached tokens fill 1,024 entries, not 2,048;
    # amazon's ~400,000 fill more than the largest automatic size
    assert t.auto_pool_size(26_415) == 1024
    assert (t.auto_pool_size(40_960), t.auto_pool_size(40_959)) == (2048, 1024)
    assert t.auto_pool_size(400_000) == t.AUTO_POOL_SIZES[1] == 4096
    assert t.auto_pool_size(0) == t.AUTO_POOL_SIZES[0]
    # the tokens fitted by default grow with the pool: 204,800 for 4,096 entries
    assert t.default_init_tokens(4096) == 204_800 and t.default_init_tokens(1024) == 51_200
    assert t.pool_size_arg("auto") == "auto" and t.pool_size_arg("256") == 256
    with pytest.raises(argparse.ArgumentTypeError, match="whole number or 'auto', got 'big'"):
        t.pool_size_arg("big")
