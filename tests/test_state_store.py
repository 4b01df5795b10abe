"""The serving state store without Ray: packed values, and both engines - embedded (SQLite) and
a real Redis server on 127.0.0.1 - with group commit, versioned (conditional) writes, idempotency
keys, writer fencing, and durability across a ``kill -9`` of the process holding the store (the
embedded engine's writer, the Redis server itself)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from artifacts import states
from artifacts.state_store import Fenced, SqliteStateStore, StoreUnavailable, Write, open_store
from models.ranker import History
from tests.test_collective_kv_jobs import tiny_ckv_ranker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows_of(model, hist: list[list[int]]) -> list[dict]:
    fb = [[i % 5 for i in range(len(h))] for h in hist]
    cache = model.prefill(History.from_lists(hist, fb))
    layout = states.Layout.of(model.cfg)
    arrays = [np.asarray(h) for h in hist]
    table = states.to_table(
        cache, list(range(len(hist))), arrays, [np.asarray(f) for f in fb], layout
    )
    return table.to_pylist()


@pytest.mark.parametrize("share", ["kv", "k"])
def test_a_packed_state_unpacks_to_the_same_row(share):
    model = tiny_ckv_ranker(share=share)
    layout = states.Layout.of(model.cfg)
    for row in rows_of(model, [[1, 2, 3], [], list(range(1, 40))]):
        value = states.pack(row, layout)
        # header + vids (int32) + feedback (int8) + exactly the state bytes
        assert len(value) == 9 + 5 * len(row["hist"]) + states.row_nbytes(row)
        assert states.unpack(row["user_id"], value, layout) == row
    with pytest.raises(ValueError, match="layout reads"):
        states.unpack(0, value + b"x", layout)


def write(user: int, version: int, value: bytes, key: str | None = None, vid: int = 1) -> Write:
    return Write(user, version, value, vid, 0, key, {"user": user, "vid": vid})


def test_versioned_writes_keys_and_figures(store_uri):
    store = open_store(store_uri, 0)
    assert store.load([(1, b"a" * 10), (2, b"b" * 20)]) == 2
    assert store.get([2, 3, 1]) == [(1, b"b" * 20), None, (1, b"a" * 10)]
    out = store.commit(
        [
            write(1, 1, b"a2", key="e1"),  # applied: version 1 -> 2
            write(1, 1, b"stale"),  # expects version 1, which is gone: a conflict
            write(1, 2, b"a3", key="e2"),  # a later event of the same group sees version 2
            write(3, 0, b"new"),  # a new user
            write(2, 0, b"again"),  # "new" but stored: a conflict
        ]
    )
    assert [o.status for o in out] == ["applied", "conflict", "applied", "applied", "conflict"]
    assert store.get([1, 3]) == [(3, b"a3"), (1, b"new")]
    # a retry of e1 is not applied again and gets its first answer
    (dup,) = store.commit([write(1, 3, b"never", key="e1", vid=9)])
    assert (dup.status, dup.answer) == ("duplicate", {"user": 1, "vid": 1})
    assert store.get([1]) == [(3, b"a3")]
    assert store.stats() == {
        "users": 3,
        "packed_bytes": 2 + 20 + 3,
        "events": 3,
        "writer_epoch": 1,
    }
    # the durable history: every applied event, in order (user, vid, feedback)
    assert [e[:3] for e in store.events()] == [(1, 1, 0), (1, 1, 0), (3, 1, 0)]
    # a load that did not finish (no meta recorded) is replaced by the next one, not added to
    assert store.load([(5, b"e" * 4)], meta={"states": "v2"}) == 1
    assert store.get([1, 5]) == [None, (1, b"e" * 4)] and store.meta("states") == "v2"
    assert (store.stats()["users"], store.stats()["packed_bytes"]) == (1, 4)
    store.close()


def test_a_second_writer_fences_the_first(store_uri):
    first = open_store(store_uri, 0)
    first.load([(1, b"v1")])
    second = open_store(store_uri, 0)  # a new replica of the same shard (a rollout)
    with pytest.raises(Fenced, match="fenced by a newer writer"):
        first.commit([write(1, 1, b"lost?")])
    assert second.get([1]) == [(1, b"v1")]  # nothing of the fenced write was stored
    assert [o.status for o in second.commit([write(1, 1, b"v2")])] == ["applied"]
    reader = open_store(store_uri, 0, writer=False)
    assert reader.get([1]) == [(2, b"v2")]
    with pytest.raises(Fenced, match="reading only"):
        reader.commit([write(1, 2, b"v3")])
    # another shard of the same store has its own writers
    assert open_store(store_uri, 1).stats()["writer_epoch"] == 1


def test_the_ingress_reads_a_shard_only_once_its_writer_has_loaded_it(store_uri):
    """services.store.ShardReader: none before the writer's load finishes (reads then go to
    the shard's deployment), no embedded shard file made where there is none, then the
    writer's committed rows, events included."""
    from services.store import ShardReader

    model = tiny_ckv_ranker()
    layout = states.Layout.of(model.cfg)
    rows = rows_of(model, [[1, 2, 3], [4, 5]])
    assert ShardReader.open_loaded(store_uri, 0, layout) is None
    if not store_uri.startswith("redis"):
        assert not os.path.exists(store_uri)  # nothing created on a machine without the shard
    writer = open_store(store_uri, 0)
    writer.load([(r["user_id"], states.pack(r, layout)) for r in rows])  # no meta: unfinished
    assert ShardReader.open_loaded(store_uri, 0, layout) is None
    writer.load([(r["user_id"], states.pack(r, layout)) for r in rows], meta={"states": "v1"})
    reader = ShardReader.open_loaded(store_uri, 0, layout)
    assert reader.get(0) == (1, rows[0]) and reader.get(7) is None
    grown = rows_of(model, [[1, 2, 3], [4, 5, 6]])[1]
    writer.commit([write(1, 1, states.pack(grown, layout), vid=6)])
    assert reader.get(1) == (2, grown)  # the writer's commit, seen without reopening
    reader.close()
    writer.close()


def test_events_arriving_together_share_one_commit(store_uri):
    """64 events submitted at once: every one applied and acknowledged, in far fewer
    commits (each one fsync) than events."""
    from services.store import Committer

    class Shard:  # what Committer uses of a ShardStore
        def __init__(self) -> None:
            self.writer = open_store(store_uri, 0)
            self.commits = 0
            commit = self.writer.commit

            def counted(writes):
                self.commits += 1
                return commit(writes)

            self.writer.commit = counted

    shard = Shard()

    async def burst():
        committer = Committer(shard)
        return await asyncio.gather(
            *(committer.submit(write(u, 0, b"s", key=f"k{u}")) for u in range(64))
        )

    outcomes = asyncio.run(burst())
    assert [o.status for o in outcomes] == ["applied"] * 64
    assert shard.writer.stats()["users"] == 64
    assert shard.commits <= 8, shard.commits


def test_every_key_of_a_redis_shard_hashes_to_one_cluster_slot():
    """One event touches its shard's meta, events, user and idempotency keys in one script:
    in a Redis Cluster they must share a slot, and the shards spread over the slots."""
    from redis.crc import key_slot

    from artifacts.redis_store import RedisStateStore, parse_uri

    store = RedisStateStore.__new__(RedisStateStore)  # the key names only, no server
    slots = set()
    for shard in range(16):
        store.base = f"kvrank:{{{shard}}}:"
        keys = [store.base + "meta", store.base + "events", store.base + "k:evt-1"]
        keys += [store.user_key(u) for u in (shard, shard + 16, 2**62)]
        (slot,) = {key_slot(k.encode()) for k in keys}
        slots.add(slot)
    assert len(slots) == 16
    assert parse_uri("redis://h:1/0?prefix=p&cluster=1") == ("redis://h:1/0", "p", True)
    with pytest.raises(ValueError, match="unknown option"):
        parse_uri("redis://h:1/0?pool=3")


def test_a_real_redis_cluster_spreads_the_shards_over_its_nodes(redis_cluster):
    """Six shards on a three-master Redis Cluster: each shard's keys live on one node, the
    shards on every node, an event on each is one script on its node, and the store lists
    every shard and its history back from the whole cluster."""
    import redis

    from artifacts.state_store import read_history, store_shards

    uri = redis_cluster.uri()
    prefix = uri.rsplit("prefix=", 1)[1]
    for shard in range(6):
        store = open_store(uri, shard)
        store.load([(shard, b"s"), (shard + 6, b"t")], meta={"states": f"v{shard}"})
        (out,) = store.commit([write(shard, 1, b"s2", key=f"e{shard}", vid=shard + 1)])
        assert out.status == "applied"
        store.close()
    holders = []
    for node in redis_cluster.nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        keys = [k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        holders.append({int(k.split("{", 1)[1].split("}", 1)[0]) for k in keys})
        client.close()
    assert sorted(s for held in holders for s in held) == list(range(6))  # one node each
    assert all(holders), holders  # and every node holds some
    assert store_shards(uri) == list(range(6))
    history = read_history(uri)
    assert [h[0] for h in history] == [f"v{s}" for s in range(6)]
    assert [[e[:2] for e in h[1]] for h in history] == [[(s, s + 1)] for s in range(6)]


def test_a_killed_redis_server_keeps_every_acknowledged_event(redis_server):
    """Events are committed as fast as they go while the Redis server is killed with SIGKILL:
    restarted from its append-only file, it holds every event that was acknowledged (and at
    most the one in flight), and a retry of the last one with its key is applied once."""
    uri = redis_server.uri()
    store = open_store(uri, 0)
    store.load([(7, b"")])
    acked: list[int] = []
    failed: list[Exception] = []

    def stream() -> None:
        version, n = 1, 0
        while True:
            try:
                (out,) = store.commit([Write(7, version, b"x" * (n + 1), n, 0, f"e{n}", {"n": n})])
            except StoreUnavailable as e:
                failed.append(e)
                return
            version = out.version
            acked.append(n)  # acknowledged: the server replied after its fsync
            n += 1

    writer = threading.Thread(target=stream)
    writer.start()
    try:
        deadline = time.time() + 60
        while len(acked) < 200 and time.time() < deadline and writer.is_alive():
            time.sleep(0.01)
        redis_server.kill()
        writer.join(timeout=60)
    finally:
        redis_server.start()
    assert failed and not writer.is_alive() and len(acked) >= 200
    again = open_store(uri, 0)  # the replica after a restart: a new writer
    ((version, value),) = again.get([7])
    last = acked[-1]
    applied = len(value)  # event n made the value n + 1 bytes long
    assert last + 1 <= applied <= last + 2
    assert version == applied + 1 and again.stats()["events"] == applied
    assert again.answer_of(f"e{last}") == {"n": last}
    (retry,) = again.commit([write(7, version, b"retry", key=f"e{last}")])
    assert retry.status == "duplicate" and again.get([7])[0][1] == value


WRITER = """
import sys
from artifacts.state_store import SqliteStateStore, Write
store = SqliteStateStore(sys.argv[1])
version = store.get([7])[0][0]
n = 0
while True:
    (out,) = store.commit([Write(7, version, b"x" * (n + 1), n, 0, f"e{n}", {"n": n})])
    version = out.version
    print(n, flush=True)  # acknowledged: committed before this line
    n += 1
"""


def test_no_acknowledged_event_is_lost_to_kill_9_of_the_embedded_writer(tmp_path):
    """A process commits events as fast as it can and is killed with SIGKILL mid-stream:
    reopened, the store holds every event it acknowledged (and at most the one in flight)."""
    path = str(tmp_path / "s.sqlite")
    SqliteStateStore(path).load([(7, b"")])
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 200:
            break
    os.kill(proc.pid, signal.SIGKILL)
    # the writer ran on between the read above and the kill: every line it printed before
    # dying is still in the pipe, and the last of them is the last acknowledged event
    for line in proc.stdout:
        acked = int(line)
    proc.wait()
    store = SqliteStateStore(path)
    ((version, value),) = store.get([7])
    applied = len(value)  # event n made the value n + 1 bytes long
    assert acked + 1 <= applied <= acked + 2
    assert version == applied + 1
    assert store.answer_of(f"e{acked}") == {"n": acked}
    # a retry of the last acknowledged event after the restart is still applied once
    (again,) = store.commit([write(7, version, b"retry", key=f"e{acked}")])
    assert again.status == "duplicate" and store.get([7])[0][1] == value
    assert json.loads(json.dumps(store.stats()))["events"] == applied


def test_the_event_history_reads_back_whole_and_in_order_past_one_page(store_uri):
    """25,000 events (Redis reads its stream in pages of 10,000): all of them, in order."""
    store = open_store(store_uri, 0)
    store.load([(1, b"x")])
    version = 1
    for group in range(25):
        writes = [write(1, version + i, b"y", vid=group * 1000 + i) for i in range(1000)]
        assert {o.status for o in store.commit(writes)} == {"applied"}
        version += 1000
    assert [e[1] for e in store.events()] == list(range(25_000))
    store.close()
