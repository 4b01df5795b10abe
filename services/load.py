"""A closed-loop HTTP load generator for the Serve app: ``concurrency`` clients each send
requests back to back for ``seconds``. Used by ``benchmarks.serve_load`` and ``demo``.
Plain asyncio + httpx; no Ray."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np


async def closed_loop(
    url: str,
    bodies: list[dict],
    concurrency: int,
    seconds: float,
    record: list | None = None,
) -> dict:
    """The figures of the run; with ``record``, every request's (end time on the
    ``time.time()`` clock, seconds it took, whether it got 200) is appended to it."""
    import httpx

    latencies, errors, done = [], 0, 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker(i: int) -> None:
            nonlocal errors, done
            rng = random.Random(i)
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, json=rng.choice(bodies))
                    ok = r.status_code == 200
                except Exception:  # noqa: BLE001 - a failed request is counted, not fatal
                    ok = False
                took = time.perf_counter() - t0
                if record is not None:
                    record.append((time.time(), took, ok))
                if ok:
                    latencies.append(took)
                    done += 1
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    n_cands = len(bodies[0]["candidate_item_ids"])
    return {
        "concurrency": concurrency,
        "requests": done,
        "errors": errors,
        "seconds": round(elapsed, 2),
        "candidate_scores_per_s": round(done * n_cands / elapsed, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p95_ms": round(float(np.percentile(lat, 95)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
    }
