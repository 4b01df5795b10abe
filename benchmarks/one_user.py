"""One user sending many events: their served state stays bounded.

    python -m benchmarks.one_user --manifest-uri out/user_states/ml-latest-small-ckv \\
        [--events 100000] [--slack 50] [--out benchmarks/results/one_user.json]

What a store deployment does per event, without Ray or HTTP around it: the Ranker engine's
``extend`` (a decode step, or past ``max_len + slack`` history items the rebuild by prefill
from the newest ``max_len``) and a durable commit of the packed state to the embedded engine
(``artifacts.state_store``, one transaction with the event and its idempotency key). Reports
the history length and packed bytes the state reaches (their maxima are the ceiling), how many
rebuilds ran, the process's RSS at the start and the end, the store file's size and events/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

from benchmarks.report import machine, write


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--manifest-uri", required=True, help="a build_user_states output")
    p.add_argument("--events", type=int, default=100_000, help="events the user sends")
    p.add_argument("--slack", type=int, default=50, help="the app's state_slack_items")
    p.add_argument("--store", default="out/bench/one_user", help="scratch store (removed)")
    p.add_argument("--out", default="benchmarks/results/one_user.json")
    a = p.parse_args(argv)

    from artifacts import states
    from artifacts.state_store import Write, open_store
    from services.engine import RankEngine

    engine = RankEngine(a.manifest_uri, slack_items=a.slack)
    shutil.rmtree(a.store, ignore_errors=True)
    store = open_store(a.store, 0)
    user, row, version = 1, engine.empty_state(1), 0
    lengths, sizes, rebuilds = [], [], 0
    rss_start = rss_mib()
    t0 = time.perf_counter()
    for i in range(a.events):
        before = len(row["hist"])
        row = engine.extend(row, 1 + i % (engine.n_items - 1), i % 3)
        rebuilds += len(row["hist"]) < before
        value = states.pack(row, engine.layout)
        answer = {"history_length": len(row["hist"])}
        (done,) = store.commit(
            [Write(user, version, value, row["hist"][-1], i % 3, f"e{i}", answer)]
        )
        if done.status != "applied":
            raise RuntimeError(f"event {i}: {done.status}")
        version = done.version
        lengths.append(len(row["hist"]))
        sizes.append(len(value))
        if (i + 1) % 10_000 == 0:
            print(
                f"{i + 1:,}/{a.events:,} events, history {lengths[-1]}, {rss_mib():.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.perf_counter() - t0
    stored = store.get([user])[0]
    store.close()  # the last connection checkpoints the write-ahead log into the file
    store_bytes = os.path.getsize(os.path.join(a.store, "shard-0.sqlite"))
    shutil.rmtree(a.store, ignore_errors=True)
    result = {
        "benchmark": "one_user",
        "states": a.manifest_uri,
        "events": a.events,
        "max_len": engine.max_len,
        "slack_items": a.slack,
        "history_length_max": max(lengths),
        "history_length_last": lengths[-1],
        "packed_bytes_max": max(sizes),
        "packed_bytes_first": sizes[0],
        "stored_version": stored[0],
        "rebuilds": rebuilds,
        "rss_mib_start": round(rss_start, 1),
        "rss_mib_end": round(rss_mib(), 1),
        "store_file_mib": round(store_bytes / 2**20, 1),
        "events_per_s": round(a.events / seconds, 1),
        "machine": machine(),
    }
    write(a.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
