"""Every user's top k of the whole catalog, with Ray Data: what /v1/recommend answers, in batch.

    python -m pipelines.recommend --states-uri out/reports/ml-latest-small-ckv-states \\
        --k 100 --out out [--run NAME] [--retrieve 500] [--include-seen]

``--states-uri`` is what the app serves: an ``evaluate --user-states --item-prior`` report (the
stored states, the prior and the fusion weight it measured) or a ``build_user_states`` folder
(the ranker alone). An actor pool of the serving engine (``services.engine.RankEngine``, the
Ranker replicas' code) takes each user's stored state and ranks the catalog in two stages:
the ``--retrieve`` items the user vector and the prior retrieve, then those with the full MIS
score and the prior; the user's history is left out unless ``--include-seen``.

Output ``<out>/recommendations/<run>/``: ``recommendations-NNNNN.parquet``, one row per user
(``user_id``, ``item_ids`` best first, ``scores``), and a marker naming the exact states,
checkpoint, item vectors, prior and weight used. Resumable: users go in parts of
``--users-per-part``, each written to ``<out>/recommendations/<run>/_parts/<states version>/``
as it finishes; a run stopped midway and started again with the same inputs skips the parts
already written, and the parts are published together at the end. Local paths or ``s3://``.
"""

from __future__ import annotations

import io
import logging
import math
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from artifacts import storage
from pipelines.common import cli, jobs

log = logging.getLogger("kvrank.recommend")


class Recommend:
    """Ray Data callable class: one serving engine per actor; a batch of users' state rows in,
    their top k out."""

    def __init__(
        self, settings: dict, k: int, retrieve: int, exclude_seen: bool, threads: int
    ) -> None:
        import torch

        from services.engine import RankEngine

        torch.set_num_threads(max(1, threads))
        self.engine = RankEngine(
            settings["manifest_uri"],
            item_prior_uri=settings["item_prior_uri"],
            item_prior_weight=settings["item_prior_weight"],
        )
        items = storage.read_table(
            self.engine.manifest["dataset_uri"], "items.parquet", columns=["item_id", "vid"]
        )
        self.item_of = np.empty(items.num_rows, dtype=np.int64)
        self.item_of[items.column("vid").to_numpy()] = items.column("item_id").to_numpy()
        self.k, self.retrieve, self.exclude_seen = k, retrieve, exclude_seen

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        n = len(rows)
        got = self.engine.recommend(rows, [self.k] * n, self.retrieve, [self.exclude_seen] * n)
        return pa.table(
            {
                "user_id": pa.array([r["user_id"] for r in rows], pa.int64()),
                "item_ids": pa.array(
                    [self.item_of[v].tolist() for v, _ in got], pa.list_(pa.int64())
                ),
                "scores": pa.array([s for _, s in got], pa.list_(pa.float32())),
            }
        )


def recommend(
    states_uri: str,
    out: str,
    *,
    k: int = 100,
    retrieve: int = 500,
    exclude_seen: bool = True,
    run: str | None = None,
    actors: int = 2,
    batch_size: int = 32,
    users_per_part: int = 100_000,
) -> dict:
    import ray

    from artifacts.states import read_states
    from pipelines.common.ranker_actors import map_with_pool
    from services.settings import ServeSettings

    t0 = time.perf_counter()
    s = ServeSettings(manifest_uri=storage.pinned(states_uri)).pinned()  # as the app resolves
    manifest, table = read_states(s.manifest_uri)
    run = run or storage.name_of(states_uri)
    target = storage.join(out, "recommendations", run)
    storage.check_writable(target)
    # parts of this exact version of the states: a resume never mixes two
    parts_uri = storage.join(target, "_parts", s.manifest_uri.rstrip("/").rsplit("/", 1)[-1])
    table = table.sort_by("user_id")
    n_parts = max(1, math.ceil(table.num_rows / users_per_part))
    settings = {
        "manifest_uri": s.manifest_uri,
        "item_prior_uri": s.item_prior_uri,
        "item_prior_weight": s.item_prior_weight,
    }
    done, reused = [], 0
    for i in range(n_parts):
        name = f"recommendations-{i:05d}.parquet"
        part = storage.join(parts_uri, name)
        users = table.slice(i * users_per_part, users_per_part)
        if storage.exists(part):
            log.info("part %d/%d: written by an earlier run, kept", i + 1, n_parts)
            done.append((name, part))
            reused += 1
            continue
        t_part = time.perf_counter()
        res = map_with_pool(
            users,
            Recommend,
            lambda threads: (settings, k, retrieve, exclude_seen, threads),
            actors=actors,
            batch_size=batch_size,
            batch_format="pyarrow",
        )
        got = pa.concat_tables(ray.get(res.to_arrow_refs())).sort_by("user_id")
        if got.num_rows != users.num_rows:  # a lost batch must not publish as a short part
            raise RuntimeError(f"part {i}: {got.num_rows} users out of {users.num_rows}")
        storage.write_bytes(part, storage.parquet_bytes(got))
        done.append((name, part))
        log.info(
            "part %d/%d: %d users in %.1f s",
            i + 1,
            n_parts,
            users.num_rows,
            time.perf_counter() - t_part,
        )
    pub = storage.Publication(target)
    try:
        rows = 0
        for name, part in done:
            data = storage.read_bytes(part)
            rows += pq.read_metadata(io.BytesIO(data)).num_rows
            pub.put_bytes(name, data)
        marker = pub.publish(
            {
                "kind": "recommendations",
                "states": s.manifest_uri,
                "dataset_uri": manifest["dataset_uri"],
                "checkpoint": manifest["checkpoint"],
                "vectors_uri": manifest.get("vectors_uri"),
                "item_prior": s.item_prior_uri,
                "item_prior_weight": s.item_prior_weight,
                "k": k,
                "retrieve": retrieve,
                "exclude_seen": exclude_seen,
                "users": rows,
                "recommendation_files": [name for name, _ in done],
            }
        )
    except BaseException:
        pub.discard()
        raise
    storage.remove_tree(storage.join(target, "_parts"))
    seconds = time.perf_counter() - t0
    return {
        "job": "recommend",
        "users": marker["users"],
        "k": k,
        "retrieve": retrieve,
        "parts": n_parts,
        "parts_reused": reused,
        "users_per_second": round(marker["users"] / max(seconds, 1e-9), 1),
        "recommendations": target,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("recommend", __doc__)
    p.add_argument(
        "--states-uri",
        required=True,
        help="what the app serves: an evaluate --user-states report, or build_user_states output",
    )
    p.add_argument("--out", required=True, help="output to <out>/recommendations/<run>/")
    p.add_argument("--k", type=int, default=100, help="items per user")
    p.add_argument(
        "--retrieve", type=int, default=500, help="items retrieved per user, then ranked"
    )
    p.add_argument(
        "--include-seen", action="store_true", help="also recommend items of the user's history"
    )
    p.add_argument("--run", default=None, help="folder name (default: the states')")
    p.add_argument(
        "--actors",
        type=int,
        default=2,
        help="engine actors (Ray Data map_batches; never more than there are batches)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="users per engine call")
    p.add_argument(
        "--users-per-part", type=int, default=100_000, help="users per part file (the resume unit)"
    )
    a = cli.parse(p, argv)
    for name in ("k", "retrieve", "actors", "batch_size", "users_per_part"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return jobs.run(
        lambda: recommend(
            a.states_uri,
            a.out,
            k=a.k,
            retrieve=a.retrieve,
            exclude_seen=not a.include_seen,
            run=a.run,
            actors=a.actors,
            batch_size=a.batch_size,
            users_per_part=a.users_per_part,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
