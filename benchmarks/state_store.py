"""The serving state store at scale: synthetic users in the default state layout (2 layers,
CollectiveKV M 1024, d_u 1, K and V shared), 50 cached tokens each, in the embedded engine.

    python -m benchmarks.state_store --users 1000000,10000000 --out out/bench/state_store

For each size: load time, bytes on disk per user, the process's peak RSS, lookup p50/p99 of 32
random users at once, durable events per second at concurrency 1 and 64 (group commit), and a
``kill -9`` of a process committing events: seconds until the reopened store serves again and
acknowledged events lost. One JSON line per size while it runs; all of them in
``benchmarks/results/state_store.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from artifacts import states
from artifacts.state_store import SqliteStateStore, Write
from models.config import CollectiveKVConfig

TOKENS = 50
LAYOUT = states.Layout(2, 256, CollectiveKVConfig(pool_size=1024, user_dim=1))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_value(rng: np.random.Generator, tokens: int = TOKENS) -> bytes:
    n = tokens - 1
    row = {
        "hist": rng.integers(0, 100_000, n).tolist(),
        "hist_fb": rng.integers(-1, 5, n).tolist(),
        "length": tokens,
    }
    for c in LAYOUT.columns():
        size = LAYOUT.per_token(c.split("_", 1)[1]) * 2 * tokens  # uint16 index or fp16
        row[c] = rng.bytes(size)
    return states.pack(row, LAYOUT)


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(path: str, users: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # 256 distinct values, reused: building 10M random values would cost more than the load
    values = [synthetic_value(rng) for _ in range(256)]
    store = SqliteStateStore(path, cache_mib=64)
    t0 = time.perf_counter()
    done = 0

    def rows():
        nonlocal done
        for u in range(users):
            done += 1
            if done % 1_000_000 == 0:
                print(f"  loaded {done:,} users ({time.perf_counter() - t0:.0f} s)", flush=True)
            yield u, values[u % 256]

    store.load(rows())
    seconds = time.perf_counter() - t0
    store.close()
    disk = sum(
        os.path.getsize(os.path.join(os.path.dirname(path), f))
        for f in os.listdir(os.path.dirname(path))
    )
    return {"load_s": round(seconds, 1), "disk_bytes_per_user": round(disk / users, 1)}


def lookups(store: SqliteStateStore, users: int, rng, n: int = 2000) -> dict:
    took = []
    for _ in range(n):
        ids = rng.integers(0, users, 32).tolist()
        t0 = time.perf_counter()
        got = store.get(ids)
        took.append(time.perf_counter() - t0)
        assert all(g is not None for g in got)
    ms = np.array(took) * 1e3
    return {
        "lookup32_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "lookup32_p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


async def events(path: str, users: int, concurrency: int, seconds: float, rng) -> float:
    """Durable events per second: ``concurrency`` clients, each appending to its own users."""
    from services.store import Committer

    class Shard:  # what Committer needs: the writer
        writer = SqliteStateStore(path, cache_mib=64)

    committer = Committer(Shard(), wait_s=0.002)
    value = synthetic_value(rng, TOKENS)
    picked = rng.choice(users, concurrency, replace=False).tolist()
    versions = [v for v, _ in Shard.writer.get(picked)]  # before any commit runs
    done = 0
    stop = time.perf_counter() + seconds

    async def client(c: int) -> None:
        nonlocal done
        user, version = picked[c], versions[c]
        while time.perf_counter() < stop:
            out = await committer.submit(Write(user, version, value, 1, 0, None, {}))
            assert out.status == "applied", out
            version = out.version
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    rate = done / (time.perf_counter() - t0)
    Shard.writer.close()
    return rate


WRITER = """
import sys
from artifacts.state_store import SqliteStateStore, Write
store = SqliteStateStore(sys.argv[1], cache_mib=64)
user = int(sys.argv[2])
(version, value), = store.get([user])
n = 0
while True:
    (out,) = store.commit([Write(user, version, value, n, 0, f"kill-{n}", {"n": n})])
    version = out.version
    print(n, flush=True)
    n += 1
"""


def kill_9(path: str, users: int) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, str(users // 2)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = []
    for line in proc.stdout:
        acked.append(int(line))
        if len(acked) >= 500:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.perf_counter()
    store = SqliteStateStore(path, cache_mib=64)
    store.get([0])
    back = time.perf_counter() - t0
    lost = sum(store.answer_of(f"kill-{n}") is None for n in acked)
    store.close()
    return {"kill9_to_serving_s": round(back, 3), "kill9_acked": len(acked), "acked_lost": lost}


def measure(users: int, folder: str, seconds: float) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    path = os.path.join(folder, "shard-0.sqlite")
    rng = np.random.default_rng(0)
    out = {"engine": "sqlite", "users": users, "tokens_per_user": TOKENS}
    out["state_bytes_per_user"] = TOKENS * 2 * (2 * 2 + 2 * 2)  # layers x (2 indices + 2 d_u)
    out["packed_bytes_per_user"] = len(synthetic_value(rng))
    out |= load(path, users, seed=1)
    store = SqliteStateStore(path, cache_mib=64, writer=False)
    out |= lookups(store, users, rng)
    store.close()
    for c in (1, 64):
        out[f"events_per_s_c{c}"] = round(asyncio.run(events(path, users, c, seconds, rng)))
    out |= kill_9(path, users)
    out["rss_peak_mib"] = round(rss_peak_mib())
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--users", default="1000000,10000000", help="sizes, comma-separated")
    p.add_argument("--out", default="out/bench/state_store", help="scratch folder (removed after)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of each events run")
    p.add_argument("--json", default="benchmarks/results/state_store.json", help="results file")
    a = p.parse_args(argv)
    rows = []
    for n in [int(x) for x in a.users.split(",")]:
        print(f"{n:,} users", flush=True)
        rows.append(measure(n, os.path.join(a.out, str(n)), a.seconds))
        print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "state_store", "machine": f"{os.cpu_count()} CPUs", "rows": rows}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"job": "state_store", "rows": len(rows), "json": a.json}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
