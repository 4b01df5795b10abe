"""The serving state store at scale: synthetic users in the default state layout (2 layers,
CollectiveKV M 1024, d_u 1, K and V shared), 50 cached tokens each, in each engine - the
embedded one (SQLite) and Redis (a redis-server this benchmark starts on 127.0.0.1, its
append-only file fsynced on every write).

    python -m benchmarks.state_store --engines sqlite,redis --users 1000000,10000000

For each engine and size: load time, bytes per user on disk (the database, or Redis's
append-only file) and in Redis's memory, the peak RSS of the process holding the data, lookup
p50/p99 of 32 random users at once, durable events per second at concurrency 1 and 64 (group
commit), and ``kill -9`` during a stream of acknowledged events - of the writing process
(SQLite) or of the server (Redis) - then seconds until the store serves again and acknowledged
events lost. One JSON line per row while it runs; all rows in
``benchmarks/results/state_store.json`` (rows of other engines or sizes already there are kept).
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
from artifacts.state_store import Write, open_store
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


class Sqlite:
    """The embedded engine: one shard's database in ``folder``; the data's process is ours."""

    name = "sqlite"

    def __init__(self, folder: str) -> None:
        self.uri = folder

    def open(self, writer: bool = True):
        return open_store(self.uri, 0, writer=writer, cache_mib=64)

    def figures(self, users: int) -> dict:
        disk = sum(os.path.getsize(os.path.join(self.uri, f)) for f in os.listdir(self.uri))
        return {"disk_bytes_per_user": round(disk / users, 1)}

    def rss_peak_mib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def kill_9(self, writer: subprocess.Popen) -> float:
        """Kill the process holding the store; seconds until a reopened store serves."""
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        t0 = time.perf_counter()
        store = self.open(writer=False)
        store.get([0])
        back = time.perf_counter() - t0
        store.close()
        return back

    def close(self) -> None:
        pass


class Redis:
    """A redis-server of our own in ``folder`` (append-only file, fsync always); the data's
    process is the server."""

    name = "redis"

    def __init__(self, folder: str) -> None:
        from benchmarks.redis_server import RedisServer

        self.server = RedisServer(folder)
        self.uri = self.server.uri("bench")
        self.base_memory = self.info("used_memory")

    def info(self, field: str) -> int:
        return int(self.server.client().info("memory")[field])

    def open(self, writer: bool = True):
        return open_store(self.uri, 0, writer=writer, redis_fsync="always")

    def figures(self, users: int) -> dict:
        aof = 0
        for root, _, files in os.walk(self.server.folder):
            aof += sum(os.path.getsize(os.path.join(root, f)) for f in files if "aof" in f)
        memory = self.info("used_memory") - self.base_memory
        return {
            "disk_bytes_per_user": round(aof / users, 1),
            "memory_bytes_per_user": round(memory / users, 1),
        }

    def rss_peak_mib(self) -> float:
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            peak = next(line for line in f if line.startswith("VmHWM:"))
        return int(peak.split()[1]) / 1024

    def kill_9(self, writer: subprocess.Popen) -> float:
        """Kill the server (then the writer, now failing); seconds until the restarted server
        has replayed its append-only file and serves."""
        self.server.kill()
        writer.kill()
        writer.wait()
        return self.server.start(timeout_s=600)

    def close(self) -> None:
        self.server.kill()


def load(engine, users: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # 256 distinct values, reused: building 10M random values would cost more than the load
    values = [synthetic_value(rng) for _ in range(256)]
    store = engine.open()
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
    return {"load_s": round(seconds, 1), **engine.figures(users)}


def lookups(store, users: int, rng, n: int = 2000) -> dict:
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


async def events(engine, users: int, concurrency: int, seconds: float, rng) -> float:
    """Durable events per second: ``concurrency`` clients, each appending to its own users."""
    from services.store import Committer

    class Shard:  # what Committer needs: the writer
        writer = engine.open()

    committer = Committer(Shard())
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
from artifacts.state_store import Write, open_store
store = open_store(sys.argv[1], 0, writer=True)
user = int(sys.argv[2])
(version, value), = store.get([user])
n = 0
while True:
    (out,) = store.commit([Write(user, version, value, n, 0, f"kill-{n}", {"n": n})])
    version = out.version
    print(n, flush=True)
    n += 1
"""


def kill_9(engine, users: int) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, engine.uri, str(users // 2)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # killed mid-commit (or its server is): its traceback
        text=True,
    )
    acked = []
    for line in proc.stdout:
        acked.append(int(line))
        if len(acked) >= 500:
            break
    back = engine.kill_9(proc)
    store = engine.open(writer=False)
    lost = sum(store.answer_of(f"kill-{n}") is None for n in acked)
    store.close()
    return {"kill9_to_serving_s": round(back, 3), "kill9_acked": len(acked), "acked_lost": lost}


ENGINES = {"sqlite": Sqlite, "redis": Redis}


def measure(engine_name: str, users: int, folder: str, seconds: float) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    engine = ENGINES[engine_name](folder)
    rng = np.random.default_rng(0)
    out = {"engine": engine.name, "users": users, "tokens_per_user": TOKENS}
    out["state_bytes_per_user"] = TOKENS * 2 * (2 * 2 + 2 * 2)  # layers x (2 indices + 2 d_u)
    out["packed_bytes_per_user"] = len(synthetic_value(rng))
    try:
        out |= load(engine, users, seed=1)
        store = engine.open(writer=False)
        out |= lookups(store, users, rng)
        store.close()
        for c in (1, 64):
            out[f"events_per_s_c{c}"] = round(asyncio.run(events(engine, users, c, seconds, rng)))
        out["rss_peak_mib"] = round(engine.rss_peak_mib())
        out |= kill_9(engine, users)
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def cluster_restart(users: int, folder: str, shards: int = 24, masters: int = 3) -> dict:
    """A Redis Cluster of ``masters`` primaries holding ``users`` in ``shards`` store shards
    (user % shards; each shard one hash slot): the users each node holds, then ``kill -9`` of
    the node holding shard 0 and seconds until a reader gets that shard's users again - what
    one node's restart costs when the users are spread."""
    import redis

    from benchmarks.redis_server import RedisCluster

    shutil.rmtree(folder, ignore_errors=True)
    cluster = RedisCluster(folder, masters=masters)
    uri = cluster.uri("bench")
    rng = np.random.default_rng(1)
    values = [synthetic_value(rng) for _ in range(256)]
    try:
        t0 = time.perf_counter()
        for shard in range(shards):
            store = open_store(uri, shard, redis_fsync="always")
            store.load((u, values[u % 256]) for u in range(shard, users, shards))
            store.close()
            print(f"  shard {shard} loaded ({time.perf_counter() - t0:.0f} s)", flush=True)
        load_s = time.perf_counter() - t0
        held = []
        for node in cluster.nodes:
            client = redis.Redis(host="127.0.0.1", port=node.port)
            held.append(int(client.dbsize()))
            client.close()
        key = open_store(uri, 0, writer=False).user_key(0)
        probe = redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
        slot = int(probe.cluster("keyslot", key))
        probe.close()
        (victim,) = [
            n for n in cluster.nodes if any(lo <= slot <= hi for lo, hi in _slots_of(n.port))
        ]
        victim_users = sum(len(range(sh, users, shards)) for sh in _shards_on(victim, uri, shards))
        victim.kill()
        t0 = time.perf_counter()
        victim.start(timeout_s=900)
        while True:  # serving again: a reader of shard 0 gets its users
            try:
                reader = open_store(uri, 0, writer=False)
                ok = reader.get([0, shards])[0] is not None
                reader.close()
                if ok:
                    break
            except Exception:  # noqa: BLE001 - the cluster is still settling
                pass
            time.sleep(0.05)
        back = time.perf_counter() - t0
    finally:
        cluster.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "engine": "redis-cluster",
        "users": users,
        "masters": masters,
        "shards": shards,
        "load_s": round(load_s, 1),
        "keys_per_node": held,
        "restarted_node_users": victim_users,
        "kill9_to_serving_s": round(back, 1),
    }


def _slots_of(port: int) -> list[tuple[int, int]]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        mine = client.cluster("myid")
        nodes = client.cluster("nodes")
    finally:
        client.close()
    for info in nodes.values():
        if info["node_id"] == (mine.decode() if isinstance(mine, bytes) else mine):
            return [tuple(map(int, r)) for r in info["slots"]]
    return []


def _shards_on(node, uri: str, shards: int) -> set[int]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=node.port)
    ranges = _slots_of(node.port)
    out = set()
    for shard in range(shards):
        key = open_store(uri, shard, writer=False).user_key(shard)
        slot = int(client.cluster("keyslot", key))
        if any(lo <= slot <= hi for lo, hi in ranges):
            out.add(shard)
    client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", default="sqlite,redis", help="engines, comma-separated")
    p.add_argument("--users", default="1000000,10000000", help="sizes, comma-separated")
    p.add_argument("--out", default="out/bench/state_store", help="scratch folder (removed after)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of each events run")
    p.add_argument("--json", default="benchmarks/results/state_store.json", help="results file")
    p.add_argument(
        "--cluster-restart",
        type=int,
        default=0,
        metavar="USERS",
        help="instead: USERS on a three-primary Redis Cluster, one node killed and restarted",
    )
    a = p.parse_args(argv)
    if a.cluster_restart:
        row = cluster_restart(a.cluster_restart, os.path.join(a.out, "redis-cluster"))
        print(json.dumps(row), flush=True)
        with open(a.json) as f:
            result = json.load(f)
        result["cluster_restart"] = row
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
        return 0
    engines = a.engines.split(",")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        p.error(f"--engines: unknown {sorted(unknown)}; one of {sorted(ENGINES)}")
    rows = []
    for engine in engines:
        for n in [int(x) for x in a.users.split(",")]:
            print(f"{engine}, {n:,} users", flush=True)
            rows.append(measure(engine, n, os.path.join(a.out, f"{engine}-{n}"), a.seconds))
            print(json.dumps(rows[-1]), flush=True)
    measured = {(r["engine"], r["users"]) for r in rows}
    kept = []
    if os.path.exists(a.json):
        with open(a.json) as f:
            kept = [r for r in json.load(f)["rows"] if (r["engine"], r["users"]) not in measured]
    rows = sorted(kept + rows, key=lambda r: (r["engine"] != "sqlite", r["engine"], r["users"]))
    result = {"benchmark": "state_store", "machine": f"{os.cpu_count()} CPUs", "rows": rows}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"job": "state_store", "rows": len(rows), "json": a.json}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
