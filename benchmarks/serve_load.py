"""Closed-loop HTTP load against the Serve app on 127.0.0.1: MIS from stored states vs a
baseline that scores every candidate with its own full forward, same model, same run.

    python -m benchmarks.serve_load --manifest-uri out/user_states/ml-latest-small-ckv \\
        [--concurrency 1,8,32,64] [--seconds 20] [--candidates 100] [--teacher TEACHER]

Starts a local Ray, the app (``services.app.build_app``) and beside it the baselines
(``benchmarks.serve_baselines``), then for
each concurrency c runs c clients that each send requests back to back for ``--seconds``: a
random stored user and ``--candidates`` distinct random items, top 10. Reports candidate scores
per second, p50/p95/p99 latency and errors, for ``/v1/rank`` (ours) and
``/baselines/v1/rank_full`` (the baseline), plus the request bytes with item ids against
sending each candidate's vector. With ``--teacher`` (a published teacher; needs vLLM, ``make
vllm-env``) the same requests also go to ``/baselines/v1/rank_teacher``: the full-text teacher
served by vLLM with prefix caching, the baseline DuoLM measures its ranker against.
Writes ``benchmarks/results/serve_load.json``. Client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

from benchmarks.report import machine, write
from services.load import closed_loop


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray import serve

    from artifacts import states, storage
    from benchmarks.serve_baselines import APP_NAME, ROUTE_PREFIX, build_baselines
    from services.app import build_app
    from services.settings import ServeSettings

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_load")
    p.add_argument("--manifest-uri", required=True, help="a build_user_states output")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--teacher", default=None, help="also load the vLLM teacher (train_teacher)")
    p.add_argument(
        "--teacher-cpus",
        type=float,
        default=0.25,
        help="CPUs reserved for the teacher replica (the defaults fit every replica in 2 CPUs)",
    )
    p.add_argument(
        "--store-users",
        default=None,
        help="store sizes to compare, e.g. 0,10000000: /v1/rank alone, the store holding that "
        "many users (user u a copy of the manifest's (u mod n)-th user's state; 0: the "
        "manifest's own users); writes benchmarks/results/serve_load_store.json",
    )
    p.add_argument(
        "--store-dir",
        default="out/bench/serve_load_store",
        help="where --store-users builds its stores (about 1.4 kB a user)",
    )
    p.add_argument("--out", default="benchmarks/results/serve_load.json")
    a = p.parse_args(argv)
    if a.store_users is not None:
        return store_sizes(a)
    manifest, table = states.read_states(a.manifest_uri)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet", columns=["item_id"])
    item_ids = items.column("item_id").to_pylist()
    users = table.column("user_id").to_pylist()
    rng = random.Random(0)
    bodies = [
        {
            "user_id": rng.choice(users),
            "candidate_item_ids": rng.sample(item_ids, a.candidates),
            "k": 10,
        }
        for _ in range(256)
    ]
    dim = 384
    with_vectors = dict(bodies[0], candidate_vectors=[[0.123456] * dim] * a.candidates)
    payload = {
        "ids_bytes": len(json.dumps(bodies[0]).encode()),
        "vectors_bytes": len(json.dumps(with_vectors).encode()),
        "vector_dim": dim,
    }
    payload["reduction"] = round(1 - payload["ids_bytes"] / payload["vectors_bytes"], 4)

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    manifest_uri = storage.absolute(a.manifest_uri)
    app = build_app({"manifest_uri": manifest_uri})
    serve.run(app, name="kvrank", route_prefix="/")
    baselines = build_baselines(
        manifest_uri,
        shards=ServeSettings(manifest_uri=manifest_uri).shards,
        teacher_uri=storage.absolute(a.teacher) if a.teacher else None,
        teacher_cpus=a.teacher_cpus,
    )
    serve.run(baselines, name=APP_NAME, route_prefix=ROUTE_PREFIX)
    targets = [("mis", "/v1/rank"), ("full_forward_baseline", f"{ROUTE_PREFIX}/v1/rank_full")]
    if a.teacher:
        targets.append(("teacher_vllm", f"{ROUTE_PREFIX}/v1/rank_teacher"))
    base = f"http://127.0.0.1:{a.port}"
    levels = [int(c) for c in a.concurrency.split(",")]
    results = {name: [] for name, _ in targets}
    for name, path in targets:
        asyncio.run(closed_loop(base + path, bodies, 1, 2.0))  # warm-up
        for c in levels:
            r = asyncio.run(closed_loop(base + path, bodies, c, a.seconds))
            results[name].append(r)
            print(name, json.dumps(r), flush=True)
    ratios = _ratios(results, "full_forward_baseline", levels)
    report = {
        "benchmark": "serve_load",
        "manifest_uri": a.manifest_uri,
        "candidates_per_request": a.candidates,
        "seconds_per_level": a.seconds,
        "results": results,
        "mis_over_baseline_scores_per_s": ratios,
        **(
            {
                "teacher": storage.absolute(a.teacher),
                "mis_over_teacher_scores_per_s": _ratios(results, "teacher_vllm", levels),
            }
            if a.teacher
            else {}
        ),
        "request_payload": payload,
        "machine": machine(),
    }
    write(a.out, report)
    serve.shutdown()
    ray.shutdown()
    summary = {"mis_over_baseline": ratios, "payload": payload}
    if a.teacher:
        summary["mis_over_teacher"] = report["mis_over_teacher_scores_per_s"]
    print(json.dumps(summary))


def fill_store(manifest_uri: str, store_uri: str, shards: int, users: int) -> dict:
    """Load ``users`` users into a fresh store at ``store_uri`` as the app would have loaded
    the manifest (its meta names the manifest, so the app opens it as it is): user u holds the
    packed state of the manifest's (u mod n)-th user."""
    import time

    from artifacts import states, storage
    from artifacts.state_store import open_store

    manifest, table = states.read_states(manifest_uri)
    layout = states.Layout.from_manifest(manifest)
    packed = [states.pack(row, layout) for row in table.to_pylist()]
    pinned = storage.resolve(manifest_uri)
    t0, step = time.perf_counter(), 1_000_000

    def rows(shard: int):
        for u in range(shard, users, shards):
            if u % step < shards:
                print(f"store shard {shard}: filling from user {u:,} of {users:,}", file=sys.stderr)
            yield u, packed[u % len(packed)]

    for shard in range(shards):
        store = open_store(store_uri, shard, writer=True)
        try:
            store.load(rows(shard), meta={"states": pinned})
        finally:
            store.close()
    os.sync()  # the fill's dirty pages written back now, not during the measurement after it
    return {
        "fill_seconds": round(time.perf_counter() - t0, 1),
        "mean_packed_bytes": round(sum(map(len, packed)) / len(packed)),
    }


def store_sizes(a) -> None:
    """``--store-users``: /v1/rank at each store size, the same model, one Ray and one run."""
    import shutil

    import ray
    from ray import serve

    from artifacts import states, storage
    from services.app import build_app
    from services.settings import ServeSettings

    manifest_uri = storage.absolute(a.manifest_uri)
    manifest, table = states.read_states(manifest_uri)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet", columns=["item_id"])
    item_ids = items.column("item_id").to_pylist()
    own = table.column("user_id").to_pylist()
    shards = ServeSettings(manifest_uri=manifest_uri).shards
    levels = [int(c) for c in a.concurrency.split(",")]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    rows = []
    for size in [int(x) for x in a.store_users.split(",")]:
        store_uri = os.path.join(os.path.abspath(a.store_dir), f"users-{size}")
        shutil.rmtree(store_uri, ignore_errors=True)
        row = {"store_users": size or len(own)}
        if size:
            row |= fill_store(manifest_uri, store_uri, shards, size)
        rng = random.Random(size)
        # enough bodies that nearly every request asks for another user
        bodies = [
            {
                "user_id": rng.randrange(size) if size else rng.choice(own),
                "candidate_item_ids": rng.sample(item_ids, a.candidates),
                "k": 10,
            }
            for _ in range(20_000)
        ]
        serve.run(
            build_app({"manifest_uri": manifest_uri, "store_uri": store_uri}),
            name="kvrank",
            route_prefix="/",
        )
        url = f"http://127.0.0.1:{a.port}/v1/rank"
        asyncio.run(closed_loop(url, bodies, 1, 2.0))  # warm-up
        row["results"] = []
        for c in levels:
            r = asyncio.run(closed_loop(url, bodies, c, a.seconds))
            row["results"].append(r)
            print(f"store_users={row['store_users']}", json.dumps(r), flush=True)
        row["store_bytes"] = sum(
            os.path.getsize(os.path.join(store_uri, f)) for f in os.listdir(store_uri)
        )
        serve.delete("kvrank")
        rows.append(row)
    serve.shutdown()
    ray.shutdown()
    first, last = rows[0]["results"][-1], rows[-1]["results"][-1]
    ratio = {
        "scores_per_s": round(last["candidate_scores_per_s"] / first["candidate_scores_per_s"], 3),
        "p99_ms": round(last["p99_ms"] / first["p99_ms"], 3),
    }
    write(
        "benchmarks/results/serve_load_store.json",
        {
            "benchmark": "serve_load_store",
            "manifest_uri": a.manifest_uri,
            "candidates_per_request": a.candidates,
            "seconds_per_level": a.seconds,
            "shards": shards,
            "rows": rows,
            "largest_over_first_at_top_concurrency": ratio,
            "machine": machine(),
        },
    )
    print(json.dumps({"benchmark": "serve_load_store", "largest_over_first": ratio}))


def _ratios(results: dict, other: str, levels: list[int]) -> dict[str, float]:
    """Candidate scores/s of ours over ``other``'s, per concurrency level."""
    ours = {r["concurrency"]: r["candidate_scores_per_s"] for r in results["mis"]}
    theirs = {r["concurrency"]: r["candidate_scores_per_s"] for r in results[other]}
    return {str(c): round(ours[c] / max(theirs[c], 1e-9), 1) for c in levels}


if __name__ == "__main__":
    main()
