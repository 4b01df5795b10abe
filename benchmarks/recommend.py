"""/v1/recommend's two stages against ranking the whole catalog, on the test split.

    python -m benchmarks.recommend --report out/reports/ml-latest-small-ckv-states \\
        [--retrieve 50,100,250,500,1000] [--max-users 0] [--out benchmarks/results/recommend.json]

``--report`` is what the app serves (an ``evaluate --user-states --item-prior`` report: the
stored states, the prior and the fusion weight it picked; or a ``build_user_states`` folder, the
ranker alone). For every test user (their stored state: history and validation item), the
engine the Ranker replicas run (``services.engine.RankEngine.recommend``) gives the top 10 of
every unseen item twice: exactly (retrieval over the whole catalog) and with each ``--retrieve``
N (the N items the user vector and the prior retrieve, ranked with the full score). Reports per
N the retrieval's recall (the share of the exact top 10 the two-stage top 10 keeps), NDCG@10
and HR@10 of the test item as served (the history the state holds left out) and with the
user's whole history left out (evaluate's protocol: the exact row is then evaluate's
full-catalog figure for the served score), and milliseconds per user in batches of 16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from benchmarks.report import machine, write

BATCH = 16


K = 10
# each call asks for more than 10, so that the items a user saw before the window their state
# holds (the newest max_len + slack; the endpoint leaves out only those) can be dropped too
ASK = 60


def ndcg_hr(top: list[int], target: int) -> tuple[float, float]:
    top = top[:K]
    if target in top:
        return 1.0 / math.log2(top.index(target) + 2), 1.0
    return 0.0, 0.0


def quality(users: list[int], tops: list[list[int]], tests: dict, seen: dict) -> dict:
    """NDCG@10 / HR@10 of the top 10 as served (``ndcg10``), and with every item of the
    user's whole input sequence left out (``ndcg10_all_seen``: evaluate's protocol)."""
    served = np.array([ndcg_hr(t, tests[u]) for u, t in zip(users, tops, strict=True)])
    unseen = np.array(
        [
            ndcg_hr([v for v in t if v not in seen[u]], tests[u])
            for u, t in zip(users, tops, strict=True)
        ]
    )
    return {
        "ndcg10": round(float(served[:, 0].mean()), 4),
        "hr10": round(float(served[:, 1].mean()), 4),
        "ndcg10_all_seen": round(float(unseen[:, 0].mean()), 4),
        "hr10_all_seen": round(float(unseen[:, 1].mean()), 4),
    }


def recall_at_10(tops: list[list[int]], exact: list[list[int]]) -> float:
    """The mean share of each exact top 10 that ``tops``' top 10 keeps."""
    kept = [
        len(set(t[:K]) & set(e[:K])) / max(1, len(e[:K])) for t, e in zip(tops, exact, strict=True)
    ]
    return round(float(np.mean(kept)), 4)


def retrieval_cost(n_items: int, width: int, users: int = 128, n: int = 500) -> dict:
    """Retrieval alone on a synthetic catalog of ``n_items`` tokens ``width`` wide, clustered
    as real catalogs are (2,000 groups, each item its group's centre plus noise), for
    ``users`` queries drawn the same way: ms per user of the exact top ``n`` (one matrix
    product and top-k in batches of 16), and of the index (``artifacts.retrieval``) at its
    default nprobe, its build time and its recall of the exact top 10 and top ``n``."""
    from artifacts import retrieval

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((2000, width)).astype(np.float32)

    def draw(k: int) -> np.ndarray:
        noise = 0.5 * rng.standard_normal((k, width)).astype(np.float32)
        return centres[rng.integers(0, len(centres), k)] + noise

    catalog, queries = draw(n_items), draw(users)
    cat_t = torch.from_numpy(catalog)
    t0 = time.perf_counter()
    exact = []
    for i in range(0, users, BATCH):
        q = torch.from_numpy(queries[i : i + BATCH])
        exact += (q @ cat_t.T).topk(n, dim=1).indices.tolist()
    exact_ms = (time.perf_counter() - t0) * 1000 / users
    t0 = time.perf_counter()
    blob, meta = retrieval.build(catalog)
    build_s = time.perf_counter() - t0
    index = retrieval.load(blob, meta)
    t0 = time.perf_counter()
    found = [f.tolist() for f in retrieval.search(index, queries, n)]
    index_ms = (time.perf_counter() - t0) * 1000 / users
    at_n = np.mean([len(set(f) & set(e)) / n for f, e in zip(found, exact, strict=True)])
    row = {
        "items": n_items,
        "width": width,
        "retrieve": n,
        "exact_ms_per_user": round(exact_ms, 3),
        "index_ms_per_user": round(index_ms, 3),
        "index_build_s": round(build_s, 1),
        "nlist": meta["nlist"],
        "nprobe": meta["nprobe"],
        "index_recall_top10": recall_at_10(found, exact),
        f"index_recall_top{n}": round(float(at_n), 4),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--report", required=True, help="an evaluate report or build_user_states")
    p.add_argument("--retrieve", default="50,100,250,500,1000", help="N values, comma-separated")
    p.add_argument("--max-users", type=int, default=0, help="test users at most (0: all)")
    p.add_argument(
        "--index-nprobe",
        default="4,16,64",
        help="then retrieve --index-retrieve items through a retrieval index of the catalog, "
        "scanning each of these numbers of its groups ('' to skip)",
    )
    p.add_argument("--index-retrieve", type=int, default=100, help="N with the index")
    p.add_argument(
        "--catalog-sizes",
        default="10000,100000,1000000",
        help="then time retrieval alone, exact and through the index, on synthetic catalogs "
        "of these sizes ('' to skip)",
    )
    p.add_argument("--out", default="benchmarks/results/recommend.json")
    a = p.parse_args(argv)

    from artifacts import states
    from artifacts.data import user_sequences
    from services.engine import RankEngine
    from services.settings import ServeSettings

    s = ServeSettings(manifest_uri=a.report).pinned()
    engine = RankEngine(
        s.manifest_uri, item_prior_uri=s.item_prior_uri, item_prior_weight=s.item_prior_weight
    )
    manifest, table = states.read_states(s.manifest_uri)
    rows = {r["user_id"]: r for r in table.to_pylist()}
    seqs = user_sequences(manifest["dataset_uri"])
    tests = dict(seqs.select("user_id", "test").iter_rows())
    seen = {u: set(h) | {v} for u, h, v in seqs.select("user_id", "hist", "valid").iter_rows()}
    users = [u for u in rows if u in tests]
    if a.max_users:
        users = users[: a.max_users]
    ns = [int(x) for x in a.retrieve.split(",")]
    exact_top: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(users), BATCH):
        batch = [rows[u] for u in users[i : i + BATCH]]
        got = engine.recommend(batch, [ASK] * len(batch), engine.n_items, [True] * len(batch))
        exact_top += [top for top, _ in got]
        print(f"exact: {i + len(batch)}/{len(users)} users", file=sys.stderr, flush=True)
    exact_ms = (time.perf_counter() - t0) * 1000 / len(users)
    result = {
        "benchmark": "recommend",
        "report": a.report,
        "states": s.manifest_uri,
        "prior_weight": s.item_prior_weight,
        "users": len(users),
        "catalog_items": engine.n_items,
        "exact": quality(users, exact_top, tests, seen) | {"ms_per_user": round(exact_ms, 2)},
        "two_stage": [],
        "machine": machine(),
    }

    def two_stage(n: int) -> dict:
        tops: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(users), BATCH):
            batch = [rows[u] for u in users[i : i + BATCH]]
            tops += [
                top
                for top, _ in engine.recommend(batch, [ASK] * len(batch), n, [True] * len(batch))
            ]
        ms = (time.perf_counter() - t0) * 1000 / len(users)
        return {
            "retrieve": n,
            "recall_of_exact_top10": recall_at_10(tops, exact_top),
            **quality(users, tops, tests, seen),
            "ms_per_user": round(ms, 2),
        }

    for n in ns:
        row = two_stage(n)
        result["two_stage"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if a.index_nprobe:
        from artifacts import retrieval

        with torch.no_grad():
            tokens = engine.model.catalog_tokens().float().cpu().numpy()
        blob, meta = retrieval.build(tokens)
        result["index"] = {"nlist": meta["nlist"], "retrieve": a.index_retrieve, "rows": []}
        for nprobe in (int(x) for x in a.index_nprobe.split(",")):
            engine.index = retrieval.load(blob, meta | {"nprobe": nprobe})
            row = {"nprobe": nprobe, **two_stage(a.index_retrieve)}
            del row["retrieve"]
            result["index"]["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        engine.index = None
    if a.catalog_sizes:
        width = int(engine.model.cfg.d_model)
        result["catalog_sizes"] = [
            retrieval_cost(n, width) for n in (int(x) for x in a.catalog_sizes.split(","))
        ]
    write(a.out, result)
    print(
        json.dumps(
            {
                "benchmark": "recommend",
                "users": len(users),
                "exact_ndcg10": result["exact"]["ndcg10"],
                "two_stage": {
                    r["retrieve"]: r["recall_of_exact_top10"] for r in result["two_stage"]
                },
                "index": {
                    r["nprobe"]: r["recall_of_exact_top10"]
                    for r in result.get("index", {}).get("rows", [])
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
