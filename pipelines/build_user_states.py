"""Build every user's compressed state (CollectiveKV) with Ray Data.

    python -m pipelines.build_user_states --dataset-uri out/datasets/ml-latest-small \\
        --checkpoint out/checkpoints/ml-latest-small-ckv --out out [--run NAME] [--include-test]

An actor pool of CollectiveKV rankers prefills each user's history (the most recent ``max_len``
items the ranker was trained to read) and keeps only what serving needs: per layer and cached
token, the K and V pool indices and the float16 user parts, plus the history's vids and feedback
(``artifacts.states`` gives the row format). Output ``<out>/user_states/<run>/``:

- ``states-NNNNN.parquet``: one row per user;
- ``catalog.faiss``, for catalogs of ``--index-items`` or more: the retrieval index
  ``/v1/recommend`` searches (``artifacts.retrieval``);
- ``_SUCCESS.json``: the manifest tying dataset, item vectors, checkpoint and states together,
  with users, tokens, state bytes, the bytes of the full fp16 KV and their ratio, and per layer
  how the routers use their pools (distinct entries / M and the entropy of their use). A router
  that sends every token to one entry has collapsed: it is listed in ``collapsed_routers`` and
  logged as a warning, since its layer then carries only the d_u user numbers per token.

By default a user's history is their training history plus the validation item: the input the
test protocol ranks from, so ``pipelines.evaluate --user-states`` can score the stored states.
``--include-test`` adds the test item too (the state to serve in production).
"""

from __future__ import annotations

import logging
import math
import sys
import time

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from artifacts import retrieval, states, storage
from artifacts.data import user_sequences
from artifacts.state_store import check_cut, check_store_uri, load_shard, open_store
from models.errors import InputError
from pipelines.common import cli, jobs
from pipelines.common.ranker_actors import RankerActor, map_with_rankers

log = logging.getLogger("kvrank.build_user_states")

USERS_PER_FILE = 100_000


class BuildStates(RankerActor):
    """Ray Data callable class: prefill a batch of users and return their state rows."""

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        from models.batches import history_batch

        hist = [np.asarray(h, dtype=np.int64)[-self.max_len :] for h in batch["input"]]
        fb = [np.asarray(f, dtype=np.int64)[-self.max_len :] for f in batch["input_fb"]]
        cache = self.model.prefill(history_batch(hist, fb, self.max_len))
        layout = states.Layout.of(self.model.cfg)
        return states.to_table(cache, list(batch["user_id"]), hist, fb, layout)


def router_use(table: pa.Table, layout: states.Layout) -> list[dict]:
    """Per layer and shared side (K, V): distinct pool entries used / M, and the entropy (bits)
    of their use."""
    np_dtype = np.dtype("<u2") if layout.ckv.index_bytes == 2 else np.dtype("<i4")
    pool_size = layout.ckv.pool_size
    out = []
    for i in range(layout.n_layers):
        row = {"layer": i}
        for kv in layout.ckv.share:
            col = table.column(states.column(i, f"idx_{kv}")).combine_chunks()
            _, offsets_buf, data = col.buffers()
            offsets = np.frombuffer(offsets_buf, dtype=np.int32)[col.offset :][: len(col) + 1]
            idx = (
                np.frombuffer(data, dtype=np.uint8)[offsets[0] : offsets[-1]].view(np_dtype)
                if len(col) and data is not None
                else np.zeros(0, dtype=np_dtype)
            )
            counts = np.bincount(idx.astype(np.int64), minlength=pool_size)
            p = counts[counts > 0] / max(1, counts.sum())
            row[f"{kv}_used"] = int((counts > 0).sum())
            row[f"{kv}_use"] = round(row[f"{kv}_used"] / pool_size, 4)
            row[f"{kv}_entropy_bits"] = round(float(-(p * np.log2(p)).sum()), 3)
        out.append(row)
    return out


def collapsed(use: list[dict]) -> list[str]:
    """Routers that send every cached token to a single pool entry."""
    return [f"layer {u['layer']} {kv}" for u in use for kv in "kv" if u.get(f"{kv}_used", 2) <= 1]


def state_inputs(dataset_uri: str, include_test: bool) -> pl.DataFrame:
    """user_id, input, input_fb: the history each user's state is built from."""
    seqs = user_sequences(dataset_uri)
    parts, fbs = ["hist", "valid"], ["hist_fb", "valid_fb"]
    if include_test:
        parts, fbs = [*parts, "test"], [*fbs, "test_fb"]
    return seqs.select(
        "user_id",
        pl.concat_list(parts).alias("input"),
        pl.concat_list(fbs).alias("input_fb"),
    )


def build(
    dataset_uri: str,
    checkpoint: str,
    out: str,
    *,
    run: str | None = None,
    vectors_uri: str | None = None,
    include_test: bool = False,
    actors: int = 2,
    batch_size: int = 32,
    user_ids: list[int] | None = None,
    store_uri: str | None = None,
    shards: int = 2,
    index_items: int = retrieval.INDEX_ITEMS,
    index_nprobe: int = retrieval.NPROBE,
) -> dict:
    """Build and publish the states; ``user_ids`` limits the build to those users (the sweep's
    sample), otherwise every user of the dataset gets one. With ``store_uri``, the published
    states are then loaded into that serving store's ``shards`` shards (``fill_store``). A
    catalog of at least ``index_items`` items gets the retrieval index ``/v1/recommend``
    searches (``artifacts.retrieval``), published with the states."""
    import ray

    from models.collective_kv import full_kv_bytes, state_bytes_per_token
    from models.config import RankerConfig

    t0 = time.perf_counter()
    dataset_uri, checkpoint = storage.pinned(dataset_uri), storage.pinned(checkpoint)
    vectors_uri = storage.pinned(vectors_uri) if vectors_uri else None
    marker = storage.read_marker(dataset_uri)
    ckpt = storage.read_marker(checkpoint)
    rc = RankerConfig.from_json(storage.read_file(checkpoint, "ranker.json").decode())
    if rc.collective_kv is None:
        raise InputError(
            f"{checkpoint} has no CollectiveKV pools: fit them first with pipelines.train_kv_pool"
        )
    if int(ckpt["n_items"]) != int(marker["items"]):
        raise InputError(
            f"{checkpoint} was trained on {ckpt['n_items']} items, "
            f"{dataset_uri} has {marker['items']}"
        )
    ckv = rc.collective_kv
    if store_uri:
        check_store_uri(store_uri)  # before the build, not after it
    users = state_inputs(dataset_uri, include_test)
    if user_ids is not None:
        users = users.filter(pl.col("user_id").is_in(list(user_ids)))
    run = run or storage.name_of(checkpoint)
    target = storage.join(out, "user_states", run)
    storage.check_writable(target)
    log.info("building states of %d users with %s", users.height, checkpoint)
    res = map_with_rankers(
        users.to_arrow(),
        BuildStates,
        checkpoint,
        vectors_uri,
        actors=actors,
        batch_size=batch_size,
    )
    table = pa.concat_tables(ray.get(res.to_arrow_refs())).sort_by("user_id")
    tokens = int(pc.sum(table.column("length")).as_py() or 0)
    stored = states.state_nbytes(table)
    expected = tokens * state_bytes_per_token(ckv, rc.n_layers, rc.kv_width)
    if stored != expected:  # the format and the closed form must agree; a mismatch is a bug
        raise RuntimeError(f"state bytes {stored} differ from the closed form {expected}")
    full = full_kv_bytes(tokens, rc.n_layers, rc.kv_width)
    layout = states.Layout.of(rc)
    index_dtype = str(layout.index_dtype)
    use = router_use(table, layout)
    bad = collapsed(use)
    if bad:
        log.warning("collapsed router(s), one pool entry for every token: %s", ", ".join(bad))
    files = []
    index_meta = None
    pub = storage.Publication(target)
    try:
        if int(ckpt["n_items"]) >= index_items:
            blob, index_meta = catalog_index(checkpoint, vectors_uri, index_nprobe)
            pub.put_bytes(retrieval.FILE, blob)
        n_files = max(1, math.ceil(table.num_rows / USERS_PER_FILE))
        step = math.ceil(table.num_rows / n_files) if table.num_rows else 1
        for f in range(n_files):
            name = f"states-{f:05d}.parquet"
            pub.put_table(name, table.slice(f * step, step))
            files.append(name)
        manifest = pub.publish(
            {
                "kind": "user_states",
                "dataset": marker["name"],
                "dataset_uri": dataset_uri,
                "vectors_uri": vectors_uri or ckpt.get("vectors_uri"),
                "checkpoint": checkpoint,
                "includes_test": include_test,
                "all_users": user_ids is None,
                "state_files": files,
                "users": table.num_rows,
                "tokens": tokens,
                "state_bytes": stored,
                "full_kv_bytes": full,
                "ratio": stored / max(1, full),
                "n_layers": rc.n_layers,
                "kv_width": rc.kv_width,
                "pool_size": ckv.pool_size,
                "user_dim": ckv.user_dim,
                "share": ckv.share,
                "index_dtype": index_dtype,
                "router_use": use,
                "collapsed_routers": bad,
                "retrieval_index": index_meta,
            }
        )
    except BaseException:
        pub.discard()
        raise
    filled = fill_store(storage.resolve(target), store_uri, shards) if store_uri else None
    return {
        "job": "build_user_states",
        "dataset": marker["name"],
        "users": manifest["users"],
        "tokens": tokens,
        "state_bytes": stored,
        "full_kv_bytes": full,
        "ratio": round(stored / max(1, full), 5),
        "bytes_per_user": round(stored / max(1, table.num_rows), 1),
        "mean_router_use": round(
            float(np.mean([u[f"{kv}_use"] for u in use for kv in ckv.share])), 4
        ),
        "collapsed_routers": bad,
        "user_states": target,
        **({"store": filled} if filled else {}),
        **({"retrieval_index": index_meta} if index_meta else {}),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def catalog_index(checkpoint: str, vectors_uri: str | None, nprobe: int) -> tuple[bytes, dict]:
    """The retrieval index of every item's candidate token under this ranker and item vectors
    (what ``RankEngine.recommend`` takes dot products with), and its manifest entry."""
    import torch

    from artifacts.data import load_ranker

    t0 = time.perf_counter()
    model, _, _ = load_ranker(checkpoint, vectors_uri)
    with torch.no_grad():
        tokens = model.eval().catalog_tokens().float().numpy()
    blob, meta = retrieval.build(tokens, nprobe=nprobe)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("retrieval index: %s", meta)
    return blob, meta


def fill_store(manifest_uri: str, store_uri: str, shards: int) -> dict:
    """Load the states at ``manifest_uri`` into the serving store at ``store_uri``, cut into
    ``shards`` shards as the app's ``shards`` setting cuts them: one Ray task a shard, so the
    Serve deployments open a store that holds their users already instead of loading them at
    start. A Redis store's tasks run anywhere in the cluster; an embedded store's on this
    machine (its folder is here). A shard that holds these states is left as it is; one that
    holds others (and the events since) is refused: serve those, or give a new store_uri."""
    import ray

    t0 = time.perf_counter()
    options = {"num_cpus": 1}
    if not check_store_uri(store_uri):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
    fill = ray.remote(_fill_shard).options(**options)
    loaded = ray.get([fill.remote(store_uri, manifest_uri, s, shards) for s in range(shards)])
    summary = {
        "uri": store_uri,
        "shards": shards,
        "users_loaded": sum(loaded),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    log.info("store %s: %s", store_uri, summary)
    return summary


def _fill_shard(store_uri: str, manifest_uri: str, shard: int, shards: int) -> int:
    # looked at as a reader first: opening a writer fences the one serving (if any), which
    # only a shard that holds no states yet may cost
    reader = open_store(store_uri, shard, writer=False)
    try:
        check_cut(reader, shard, shards)
        held = reader.meta("states")
    finally:
        reader.close()
    if held == manifest_uri:
        return 0
    if held is not None:
        raise InputError(
            f"{store_uri} shard {shard} holds the states of {held} and the events since, not "
            f"{manifest_uri}: give build_user_states a new --store-uri (and the app that "
            "store_uri)"
        )
    store = open_store(store_uri, shard, writer=True)
    try:
        return load_shard(store, manifest_uri, shard, shards) or 0
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("build_user_states", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset whose users to build")
    p.add_argument("--checkpoint", required=True, help="a CollectiveKV ranker checkpoint")
    p.add_argument("--out", required=True, help="states go to <out>/user_states/<run>/")
    p.add_argument("--run", default=None, help="folder name (default: the checkpoint's)")
    p.add_argument("--vectors-uri", help="item vectors (default: the checkpoint's)")
    p.add_argument(
        "--include-test", action="store_true", help="add the test item (states to serve)"
    )
    p.add_argument(
        "--actors",
        type=int,
        default=2,
        help="prefill actors (Ray Data map_batches; never more than there are batches)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="users per prefill forward")
    p.add_argument(
        "--store-uri",
        help="then load the states into this serving store (a local folder or redis://; the "
        "app's store_uri), so its shards open holding their users",
    )
    p.add_argument(
        "--shards", type=int, default=2, help="with --store-uri: the app's shards setting"
    )
    p.add_argument(
        "--index-items",
        type=int,
        default=retrieval.INDEX_ITEMS,
        help="catalogs of at least this many items get a retrieval index for /v1/recommend "
        "(smaller ones are searched exactly)",
    )
    p.add_argument(
        "--index-nprobe",
        type=int,
        default=retrieval.NPROBE,
        help="index groups a retrieval query scans (more: better recall, slower)",
    )
    a = cli.parse(p, argv)
    if min(a.actors, a.batch_size, a.shards, a.index_items, a.index_nprobe) <= 0:
        p.error("--actors, --batch-size, --shards, --index-items and --index-nprobe must be > 0")
    return jobs.run(
        lambda: build(
            a.dataset_uri,
            a.checkpoint,
            a.out,
            run=a.run,
            vectors_uri=a.vectors_uri,
            include_test=a.include_test,
            actors=a.actors,
            batch_size=a.batch_size,
            store_uri=a.store_uri,
            shards=a.shards,
            index_items=a.index_items,
            index_nprobe=a.index_nprobe,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
