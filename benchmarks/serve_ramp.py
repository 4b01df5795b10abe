"""The Ranker deployment autoscaling under a load ramp, watched: replicas, scores/s and p99 over
time, against the app on 127.0.0.1.

    python -m benchmarks.serve_ramp --manifest-uri out/user_states/ml-latest-small-ckv \\
        [--phases 1:40,64:120,1:150] [--max-replicas 3] [--ranker-cpus 0.25] \\
        [--upscale-delay-s 5] [--downscale-delay-s 30] [--out benchmarks/results/serve_ramp.json]

Starts a local Ray and the app (``services.app.build_app``) with the Ranker autoscaling between
1 and ``--max-replicas`` replicas of ``--ranker-cpus`` CPUs each, then runs the phases
(concurrency:seconds, closed-loop clients sending ``/v1/rank`` for a random stored user and 100
random candidates), while a sampler reads the Ranker's replica count from Serve every second.
Writes the timeline (per second: concurrency, running replicas, scores/s, p99, errors) to JSON
and a plot beside it (``.png``). The delays here are short so the ramp fits in minutes; the
app's defaults are Serve's own (30 s up, 600 s down).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

import numpy as np

from benchmarks.report import machine, write
from services.load import closed_loop


def replicas(app: str = "kvrank", deployment: str = "Ranker") -> int:
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return int(states.get("RUNNING", 0))


def timeline(record: list, samples: list, phases: list, t_start: float, n_cands: int) -> list:
    """Per second since ``t_start``: the phase's concurrency, running replicas (the sampler's
    last reading), scores/s, p99 and errors of the requests that ended in that second."""
    end = max([t for t, _, _ in record] + [s[0] for s in samples] + [t_start])
    out = []
    bounds = np.cumsum([0] + [s for _, s in phases])
    for sec in range(int(end - t_start) + 1):
        lo, hi = t_start + sec, t_start + sec + 1
        ok = [took for t, took, good in record if lo <= t < hi and good]
        bad = sum(1 for t, _, good in record if lo <= t < hi and not good)
        seen = [n for t, n in samples if t < hi]
        phase = int(np.searchsorted(bounds, sec, side="right")) - 1
        out.append(
            {
                "t": sec,
                "concurrency": phases[min(phase, len(phases) - 1)][0],
                "replicas": seen[-1] if seen else None,
                "scores_per_s": len(ok) * n_cands,
                "p99_ms": round(float(np.percentile(ok, 99)) * 1000, 1) if ok else None,
                "errors": bad,
            }
        )
    return out


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].step(t, [r["replicas"] or 0 for r in rows], where="post", color="C0")
    axes[0].set_ylabel("Ranker replicas", color="C0")
    axes[0].set_ylim(0, max(r["replicas"] or 0 for r in rows) + 1)
    clients = axes[0].twinx()
    clients.step(t, [r["concurrency"] for r in rows], where="post", color="C1", alpha=0.6)
    clients.set_ylabel("clients", color="C1")
    axes[1].plot(t, [r["scores_per_s"] for r in rows])
    axes[1].set_ylabel("candidate scores/s")
    axes[2].plot(t, [r["p99_ms"] or np.nan for r in rows])
    axes[2].set_ylabel("p99 ms (per second)")
    axes[2].set_xlabel("seconds")
    fig.suptitle("kvrank /v1/rank under a load ramp: the Ranker autoscaling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--manifest-uri", required=True, help="what to serve (states or a report)")
    p.add_argument("--phases", default="1:40,64:120,1:150", help="concurrency:seconds, ...")
    p.add_argument("--max-replicas", type=int, default=3)
    p.add_argument("--ranker-cpus", type=float, default=0.25)
    p.add_argument("--target-ongoing", type=float, default=8.0, help="requests per replica")
    p.add_argument("--upscale-delay-s", type=float, default=5.0)
    p.add_argument("--downscale-delay-s", type=float, default=30.0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="benchmarks/results/serve_ramp.json")
    a = p.parse_args(argv)
    phases = [(int(c), float(s)) for c, s in (x.split(":") for x in a.phases.split(","))]

    import ray
    from ray import serve

    from artifacts import states, storage
    from services.app import build_app
    from services.settings import ServeSettings

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    settings = {
        "manifest_uri": a.manifest_uri,
        "ranker_min_replicas": 1,
        "ranker_max_replicas": a.max_replicas,
        "ranker_num_cpus": a.ranker_cpus,
        "ranker_target_ongoing_requests": a.target_ongoing,
        "ranker_upscale_delay_s": a.upscale_delay_s,
        "ranker_downscale_delay_s": a.downscale_delay_s,
        "store_uri": os.path.join(os.path.abspath("out"), "bench", f"ramp-{os.getpid()}"),
    }
    serve.run(build_app(settings), name="kvrank", route_prefix="/")
    served = ServeSettings(manifest_uri=a.manifest_uri).pinned().manifest_uri  # a report's states
    manifest, table = states.read_states(served)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet", columns=["item_id"])
    catalog = items.column("item_id").to_pylist()
    users = table.column("user_id").to_pylist()
    rng = random.Random(0)
    n_cands = 100
    bodies = [
        {"user_id": rng.choice(users), "candidate_item_ids": rng.sample(catalog, n_cands), "k": 10}
        for _ in range(512)
    ]
    url = f"http://127.0.0.1:{a.port}/v1/rank"
    asyncio.run(closed_loop(url, bodies, 1, 3.0))  # warm-up
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), replicas()))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    record: list = []
    t_start = time.time()
    sampler.start()
    summaries = []
    try:
        for c, seconds in phases:
            print(f"phase: {c} clients for {seconds:.0f} s", file=sys.stderr, flush=True)
            summaries.append(asyncio.run(closed_loop(url, bodies, c, seconds, record)))
            print(json.dumps(summaries[-1]), file=sys.stderr, flush=True)
    finally:
        stop.set()
        sampler.join()
        serve.shutdown()
        ray.shutdown()
    rows = timeline(record, samples, phases, t_start, n_cands)
    counts = [r["replicas"] for r in rows if r["replicas"] is not None]
    result = {
        "benchmark": "serve_ramp",
        "manifest_uri": a.manifest_uri,
        "settings": {k: v for k, v in settings.items() if k.startswith("ranker_")},
        "phases": [{"concurrency": c, "seconds": s} for c, s in phases],
        "summary": {
            "requests": sum(s["requests"] for s in summaries),
            "errors": sum(s["errors"] for s in summaries),
            "replicas_min_max": [min(counts), max(counts)] if counts else None,
            "replicas_at_end": counts[-1] if counts else None,
            "phases": summaries,
        },
        "timeline": rows,
        "machine": machine(),
    }
    write(a.out, result)
    plot(rows, os.path.splitext(a.out)[0] + ".png")
    print(
        json.dumps(
            {"benchmark": "serve_ramp"}
            | {
                k: result["summary"][k]
                for k in ("requests", "errors", "replicas_min_max", "replicas_at_end")
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
