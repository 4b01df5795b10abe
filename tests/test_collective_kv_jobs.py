"""CollectiveKV as jobs: stored states round trip (local and s3), the pool fit and state build on
a tiny dataset (bytes = the closed form), evaluation from stored states = from a fresh prefill,
and a collapsed router is reported."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import polars as pl
import pytest
import torch

from artifacts import data, states, storage
from artifacts.state_store import Write, open_store
from models.collective_kv import state_bytes_per_token
from models.config import CollectiveKVConfig
from models.ranker import History, Ranker
from pipelines import analyze_kv, build_user_states, evaluate, train_kv_pool
from pipelines.common import kv_inputs
from tests.test_ranker import tiny_ranker
from tests.tiny import N_USERS, run_json


def tiny_ckv_ranker(user_dim: int = 2, share: str = "kv") -> Ranker:
    ckv = CollectiveKVConfig(
        pool_size=64, user_dim=user_dim, **CollectiveKVConfig.share_flags(share)
    )
    return tiny_ranker(ckv, item_input="id")


@pytest.mark.parametrize(("where", "share"), [("local", "kv"), ("s3", "kv"), ("local", "k")])
def test_state_round_trip_through_parquet(where, share, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket")
    model = tiny_ckv_ranker(share=share)
    layout = states.Layout.of(model.cfg)
    hist = [np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8, 9, 10]), np.array([11])]
    fb = [np.array([0, 1, 2]), np.full(7, 3), np.array([-1])]
    history = History.from_lists([h.tolist() for h in hist], [f.tolist() for f in fb])
    cache = model.prefill(history)
    uri = storage.join(root, "states", "part.parquet")
    storage.write_bytes(
        uri, storage.parquet_bytes(states.to_table(cache, [7, 8, 9], hist, fb, layout))
    )
    table = storage.read_parquet(uri)
    assert table.column("user_id").to_pylist() == [7, 8, 9]
    assert table.column("hist").to_pylist()[1] == hist[1].tolist()
    assert (
        states.state_nbytes(table)
        == cache.nbytes()
        == 14 * state_bytes_per_token(model.cfg.collective_kv, 2, model.cfg.kv_width)
    )
    assert [c for c in table.column_names if c.startswith("l0_")] == [
        f"l0_{f}" for f in ("idx_k", "idx_v", "u_k", "u_v") if f[:3] != "idx" or f[-1] in share
    ]
    back = states.from_table(table, layout)
    assert torch.equal(back.lengths, cache.lengths)

    def bits(t: torch.Tensor) -> torch.Tensor:  # uint16 has no equality kernel on CPU
        return t.view(torch.int16) if t.dtype == torch.uint16 else t

    for a, b in zip(cache.layers, back.layers, strict=True):
        for f in layout.fields:
            assert getattr(a, f).dtype == getattr(b, f).dtype
            for u, n in enumerate(cache.lengths.tolist()):  # padding is not stored
                assert torch.equal(bits(getattr(a, f))[u, :n], bits(getattr(b, f))[u, :n])
    cands = torch.randint(0, 60, (3, 12))
    assert torch.equal(model.score(cache, cands), model.score(back, cands))
    wider = dataclasses.replace(layout, ckv=dataclasses.replace(layout.ckv, user_dim=4))
    with pytest.raises(ValueError, match="does not match the model"):
        states.from_table(table, wider)  # read with the wrong d_u
    if share != "kv":  # read as if both were shared: the missing index column is named
        both = dataclasses.replace(layout, ckv=dataclasses.replace(layout.ckv, share_v=True))
        with pytest.raises(ValueError, match="no column l0_idx_v"):
            states.from_table(table, both)


def test_router_use_and_collapse_detection():
    model = tiny_ckv_ranker()
    with torch.no_grad():
        # items as distinct as a trained ranker's (at init their tokens are small beside the
        # feedback embedding all tokens share, and an untrained router may see one token)
        model.item_emb.weight.normal_()
        # every token gets the same logits (the bias): one entry wins them all
        model.layers[1].self_attn.ckv.router_v.weight.zero_()
    hist = [np.arange(1, 30), np.arange(20, 45)]
    fb = [np.zeros(29, dtype=int), np.zeros(25, dtype=int)]
    cache = model.prefill(History.from_lists([h.tolist() for h in hist]))
    layout = states.Layout.of(model.cfg)
    table = states.to_table(cache, [1, 2], hist, fb, layout)
    use = build_user_states.router_use(table, layout)
    assert use[1]["v_used"] == 1 and use[1]["v_entropy_bits"] == 0.0
    assert use[0]["k_used"] > 1 and use[0]["k_entropy_bits"] > 0
    assert build_user_states.collapsed(use) == ["layer 1 v"]


def test_the_pools_are_fitted_to_enough_users_for_the_token_budget():
    seqs = pl.DataFrame({"user_id": range(100), "hist": [[1, 2, 3]] * 50 + [list(range(80))] * 50})
    rng = np.random.default_rng
    picked = kv_inputs.sample_users(seqs, rng(0), users=0, max_tokens=200, max_len=50)
    tokens = picked["hist"].list.len().clip(upper_bound=50) + 1  # 4 or 51 a user
    # the fewest users that reach the budget: all but the last are under it
    assert tokens.sum() >= 200 > tokens.sum() - tokens.max() and picked.height < 100
    assert picked["user_id"].is_sorted() and picked["user_id"].is_unique().all()
    assert kv_inputs.sample_users(seqs, rng(0), users=7, max_tokens=200, max_len=50).height == 7
    everyone = kv_inputs.sample_users(seqs, rng(0), users=0, max_tokens=10**6, max_len=50)
    assert everyone.height == 100


def test_fit_pools_build_states_and_evaluate_from_them(tiny_trained, tmp_path, capsys):
    """analyze_kv on the tiny chain's ranker, then what the chain's train_kv_pool and
    build_user_states made of it (tests.tiny.tiny_chain), evaluated from the stored states."""
    out, ds, base = str(tmp_path / "out"), tiny_trained["dataset"], tiny_trained["base"]
    analysis = run_json(
        capsys,
        analyze_kv.main,
        ["--dataset-uri", ds, "--checkpoint", base["checkpoint"], "--out", out]
        + ["--users", "10", "--rank", "2"],
    )
    assert (analysis["users"], analysis["random_overlap"]) == (10, 2 / 32)
    report = json.loads(storage.read_file(analysis["report"], "analysis.json"))
    for layer in report["layers"]:
        for kv in ("k", "v"):
            a = layer[kv]
            shares = [a["energy_top"][r] for r in ("1", "2", "4", "16", "64")]
            assert shares == sorted(shares) and 0 < shares[0] and shares[-1] <= 1 + 1e-9
            assert a["users_compared"] == 10
            # the principal parts of different users' keys overlap far beyond chance
            assert a["random_overlap"] < a["principal_overlap"] <= 1 + 1e-9
            assert 0 <= a["residual_overlap"] <= 1 + 1e-9
    for png in ("spectrum.png", "sharing.png"):
        assert storage.read_file(analysis["report"], png)[:4] == b"\x89PNG"

    # the tiny chain's pool fit, made with train_kv_pool's command line (tests.tiny.TINY_FIT)
    fit = tiny_trained["fit"]
    # auto sizes the pool to the 100 tokens it was given to fit to: under 20 an entry even at the
    # smallest automatic size, so that one
    assert fit["init_tokens"] == 100 and fit["pool_size_auto"]
    assert fit["pool_size"] == train_kv_pool.AUTO_POOL_SIZES[0] == 16
    # ... and the job says what would fill that pool
    assert [w for w in tiny_trained["fit_warnings"] if "k-means fitted" in w] == [
        "k-means fitted 16 pool entries to 100 tokens (6.2 an entry): give --init-tokens 320 "
        "or more, or a smaller --pool-size"
    ]
    # 40 users in batches of 8 are 5 steps an epoch; --max-steps cut the fine-tune at 2
    history = json.loads(storage.read_file(fit["checkpoint"], "metrics.json"))
    assert [m["steps"] for m in history] == [2]
    # the fine-tune was distilled from the base: a compressed KV scores differently, so the
    # KL from the base's candidate and catalog softmaxes is above zero
    assert fit["base_distill_weight"] == 1 and history[0]["distill_loss"] > 0
    # the router starts as the nearest-entry classifier of the k-means pool: it makes the
    # k-means assignment's choices (up to float ties)
    assert (
        0
        < fit["layer0_k_router_rel_error"]
        == pytest.approx(fit["layer0_k_kmeans_rel_error"], rel=1e-3)
    )
    # two actors finish their batches in either order, one actor in one: one seed still
    # collects the same tokens (their K/V equal up to float rounding: an actor's batch, and so
    # its padding and reduction order, depends on how the users were split); the cap at
    # --init-tokens is the chain's fit's (init_tokens 100 above)
    collected = [
        kv_inputs.collect_kv_inputs(base["checkpoint"], ds, users=0, max_tokens=10**9, actors=a)
        for a in (2, 1)
    ]
    (xs_a, user_a), (xs_b, user_b) = collected
    assert np.array_equal(user_a, user_b) and user_a.tolist() == sorted(user_a)
    # float32 rounding relative to the values' scale (the normed inputs reach tens)
    worst = max(
        float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
        for a, b in zip(xs_a, xs_b, strict=True)
    )
    assert worst < 1e-5, (worst, [float(np.abs(b).max()) for b in xs_b])
    # what auto counts as the cached tokens there are is what a collection without a token cap
    # returns: every user's, or those of the seeded users --init-users samples
    counted = kv_inputs.cached_tokens(ds, base["checkpoint"], users=0, seed=0)
    assert counted == len(user_b) == fit["cached_tokens"] and len(np.unique(user_b)) == N_USERS
    _, some = kv_inputs.collect_kv_inputs(
        base["checkpoint"], ds, users=7, max_tokens=10**9, actors=1
    )
    assert kv_inputs.cached_tokens(ds, base["checkpoint"], users=7, seed=0) == len(some)
    assert len(np.unique(some)) == 7
    model, marker = data.load_checkpoint(fit["checkpoint"])
    # the fine-tune names the exact version of the ranker it started from
    assert model.cfg.collective_kv.user_dim == 2
    assert marker["base_checkpoint"] == storage.resolve(base["checkpoint"])
    # --tune kv: the fine-tune moved the cache's routers, pools and user projections from their
    # fitted start and left every other weight exactly the base's
    tuned = set(model.compressed_kv_parameters())
    start = torch.load(
        io.BytesIO(storage.read_bytes(storage.join(fit["checkpoint"], "train", "init", "model.pt")))
    )
    base_weights = data.load_checkpoint(base["checkpoint"])[0].state_dict()
    for name, w in model.state_dict().items():
        if name in tuned:
            assert not torch.equal(w, start[name]), name
        elif name in base_weights:
            assert torch.equal(w, base_weights[name]), name

    built = tiny_trained["states"]  # build_user_states --actors 1 of that fit
    # tokens: BOS + the most recent max_len (10) items of history + validation item
    inputs = build_user_states.state_inputs(ds, include_test=False)
    tokens = int(inputs["input"].list.len().clip(upper_bound=10).sum()) + N_USERS
    per_token = 2 * (2 * 2 + 2 * 2 * 2)  # layers * (two uint16 indices + 2 * d_u fp16)
    assert (built["users"], built["tokens"]) == (N_USERS, tokens)
    assert built["state_bytes"] == tokens * per_token
    assert built["ratio"] == pytest.approx(per_token / (2 * 2 * 32 * 2), abs=1e-5)
    manifest, table = states.read_states(built["user_states"])
    # the manifest names the exact versions of its inputs
    assert manifest["checkpoint"] == storage.resolve(fit["checkpoint"])
    assert manifest["dataset_uri"] == storage.resolve(ds)
    assert table.num_rows == N_USERS

    from_states = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--user-states", built["user_states"], "--out", out]
        + ["--actors", "1"],
    )
    fresh = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--checkpoint", fit["checkpoint"], "--out", out]
        + ["--actors", "1", "--report", "fresh"],
    )

    def ranks(report: str) -> pl.DataFrame:
        t = storage.read_table(report, "per_user.parquet")
        return pl.from_arrow(t).select("user_id", "ranker_full_rank", "ranker_sampled_rank")

    assert from_states["report"] != fresh["report"]
    assert from_states["ratio"] == built["ratio"]
    states_report = json.loads(storage.read_file(from_states["report"], "metrics.json"))
    assert set(states_report["metrics"]) == {"ranker", "uncompressed", "most_popular"}
    assert (
        ranks(from_states["report"]).sort("user_id").equals(ranks(fresh["report"]).sort("user_id"))
    )

    # the same states in the serving store, read as serving reads them: the same ranks; once an
    # event has changed a test user's history there, evaluating the store is refused
    store = str(tmp_path / "store")
    pinned = storage.resolve(built["user_states"])
    assert build_user_states.fill_store(pinned, store, 2)["users_loaded"] == N_USERS
    served = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--user-states", store, "--out", out, "--actors", "1"],
    )
    assert served["store_uri"] == store and served["report"] != from_states["report"]
    assert ranks(served["report"]).sort("user_id").equals(ranks(fresh["report"]).sort("user_id"))
    test_item = dict(zip(*evaluate.eval_users(ds, None, 0).select("user_id", "test"), strict=True))
    layout = states.Layout.from_manifest(manifest)
    row = table.to_pylist()[0]
    uid = row["user_id"]
    changed = {**row, "hist": [*row["hist"][:-1], test_item[uid]]}
    writer = open_store(store, uid % 2)
    assert (
        writer.commit([Write(uid, 1, states.pack(changed, layout), test_item[uid], 0, None, {})])[
            0
        ].status
        == "applied"
    )
    writer.close()
    rc = evaluate.main(["--dataset-uri", ds, "--user-states", store, "--out", out])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"the stored history of 1 test users (user {uid} first)" in err
    assert "events were applied to them since the states were built" in err

    # a checkpoint whose layer-0 K router sends every token to one entry: reported
    state = torch.load(io.BytesIO(storage.read_file(fit["checkpoint"], "model.pt")))
    state["layers.0.self_attn.ckv.router_k.weight"].zero_()
    broken = storage.join(out, "checkpoints", "collapsed")
    pub = storage.Publication(broken)
    buf = io.BytesIO()
    torch.save(state, buf)
    pub.put_bytes("model.pt", buf.getvalue())
    for name in ("ranker.json", "train.json"):
        pub.put_bytes(name, storage.read_file(fit["checkpoint"], name))
    meta = {k: v for k, v in marker.items() if k not in ("files", "published_at")}
    pub.publish(meta)
    collapsed = run_json(
        capsys,
        build_user_states.main,
        ["--dataset-uri", ds, "--checkpoint", broken, "--out", out, "--actors", "1"],
    )
    assert collapsed["collapsed_routers"] == ["layer 0 k"]
    assert storage.read_marker(collapsed["user_states"])["collapsed_routers"] == ["layer 0 k"]


def test_states_need_a_collective_kv_checkpoint(tiny, capsys):
    base = storage.join(tiny["out"], "checkpoints", "missing")
    rc = build_user_states.main(
        ["--dataset-uri", tiny["dataset"], "--checkpoint", base, "--out", tiny["out"]]
    )
    assert rc == 2
    assert "not a complete publication" in capsys.readouterr().err


def test_built_states_go_into_the_serving_store_with_their_retrieval_index(
    tiny_trained, redis_server, redis_cluster, tmp_path, capsys
):
    """build_user_states --store-uri loads the published states into the store, cut as the
    app's shards setting cuts them: each shard then opens holding exactly its users' packed
    states (nothing loaded at start); filling again is a no-op; a store holding other states,
    or opened with another number of shards, is refused with what to do. The job fills the
    embedded engine; the same fill (one Ray task a shard) fills Redis and a Redis Cluster.
    A catalog of --index-items or more gets a retrieval index in the states' version, which
    the serving engine loads and retrieves through as exactly as the matrix product when it
    scans every group."""
    from models.errors import InputError
    from services.engine import RankEngine
    from services.store import ShardStore

    ds, fit = tiny_trained["dataset"], tiny_trained["fit"]
    local = str(tmp_path / "store")
    built = run_json(
        capsys,
        build_user_states.main,
        ["--dataset-uri", ds, "--out", str(tmp_path / "out"), "--checkpoint", fit["checkpoint"]]
        + ["--actors", "1", "--store-uri", local, "--shards", "3"]
        + ["--index-items", "1", "--index-nprobe", "1000"],
    )
    pinned = storage.resolve(built["user_states"])
    assert built["store"]["users_loaded"] == built["users"] == N_USERS
    manifest, table = states.read_states(pinned)
    layout = states.Layout.from_manifest(manifest)
    index = manifest["retrieval_index"]
    assert index == built["retrieval_index"] and index["nprobe"] == index["nlist"]
    assert index["items"] == int(storage.read_marker(fit["checkpoint"])["n_items"])
    engine = RankEngine(pinned)
    assert engine.index is not None and engine.index.ntotal == index["items"]
    rows = table.to_pylist()[:8]
    with_index = engine.recommend(rows, [5] * 8, 10, [True] * 8)
    engine.index = None
    assert with_index == engine.recommend(rows, [5] * 8, 10, [True] * 8)
    other = storage.resolve(tiny_trained["states"]["user_states"])
    for store_uri in (local, redis_server.uri(), redis_cluster.uri()):
        if store_uri != local:
            assert build_user_states.fill_store(pinned, store_uri, 3)["users_loaded"] == N_USERS
        for shard in range(3):
            opened = ShardStore(pinned, store_uri, shard, 3)
            try:
                mine = [r for r in table.to_pylist() if r["user_id"] % 3 == shard]
                got = opened.reader.get([r["user_id"] for r in mine])
                assert [g[1] for g in got] == [states.pack(r, layout) for r in mine]
                assert opened.reader.meta("users") == str(len(mine))
            finally:
                opened.close()
        assert build_user_states.fill_store(pinned, store_uri, 3)["users_loaded"] == 0
        with pytest.raises(InputError, match="holds the states of .* new --store-uri"):
            build_user_states.fill_store(other, store_uri, 3)
        with pytest.raises(InputError, match="loaded for 3 shards, not 2: serve it with shards"):
            ShardStore(pinned, store_uri, 0, 2)
        reader = open_store(store_uri, 0, writer=False)
        assert reader.meta("states") == pinned  # nothing of it changed
        reader.close()
