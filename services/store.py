"""One shard of the user-state store, without Ray: its users' packed states in a state engine
(``artifacts.state_store.open_store``), loaded once from the published states, then changed only
by acknowledged events.

A shard owns the users with ``user_id % shards == shard``. With a local ``store_uri`` its
database is ``<store_uri>/shard-<i>.sqlite`` on a local disk (a persistent volume on a
cluster); with ``redis://...`` its keys are on that server, under the shard's hash tag. The first
start loads the shard's rows from the published states and records which version it loaded;
later starts open the database as it is, with every event acknowledged since. Events are
committed in groups (``Committer``): the events that arrive while a commit is in flight share the
next one - one transaction and one fsync - and each is acknowledged only after its commit
returned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from artifacts import states, storage
from artifacts.state_store import Outcome, Write, load_shard, open_store

log = logging.getLogger("kvrank.store")


class ShardReader:
    """Reads of one shard's committed states, for any process on the store's machine (SQLite
    in WAL mode lets readers beside the writer) or any that reaches its server (Redis). The
    ingress reads through one of these instead of asking the shard's deployment: a state read
    was a Serve call of ~4.5 ms around a 0.2 ms lookup (benchmarks.serve_load, lab log)."""

    def __init__(self, store_uri: str, shard: int, layout: states.Layout, **kw) -> None:
        self.engine = open_store(store_uri, shard, writer=False, **kw)
        self.layout = layout
        self.lock = threading.Lock()  # one connection: one thread at a time on it

    @classmethod
    def open_loaded(cls, store_uri: str, shard: int, layout: states.Layout, **kw):
        """A reader of the shard once its writer has finished its first load (a reader sees
        whole loads), else None. An embedded shard's file is never created from here: on a
        machine other than its writer's there is none, and reads go to the deployment."""
        from artifacts import redis_store

        if not redis_store.is_redis(store_uri):
            if not os.path.exists(storage.join(store_uri, f"shard-{shard}.sqlite")):
                return None
        reader = cls(store_uri, shard, layout, **kw)
        if reader.engine.meta("states") is None:
            reader.close()
            return None
        return reader

    def get(self, user_id: int) -> tuple[int, dict] | None:
        """(version, state row) of a user, or None."""
        with self.lock:
            (got,) = self.engine.get([user_id])
        if got is None:
            return None
        version, value = got
        return version, states.unpack(user_id, value, self.layout)

    def close(self) -> None:
        self.engine.close()


class ShardStore:
    def __init__(
        self,
        manifest_uri: str,
        store_uri: str,
        shard: int,
        shards: int,
        cache_mib: int = 64,
        redis_fsync: str = "always",
    ) -> None:
        self.manifest = storage.read_marker(manifest_uri)
        self.layout = states.Layout.from_manifest(self.manifest)
        self.shard, self.shards = shard, shards
        t0 = time.perf_counter()
        kw = {"cache_mib": cache_mib, "redis_fsync": redis_fsync}
        self.writer = open_store(store_uri, shard, writer=True, **kw)
        # reads take their own connection: they never wait on a commit (WAL readers see the
        # last committed state) and run on the caller's thread while commits run on another
        self.reads = ShardReader(store_uri, shard, self.layout, **kw)
        self.reader = self.reads.engine
        loaded = load_shard(self.writer, manifest_uri, shard, shards)
        pinned = storage.resolve(manifest_uri)
        if loaded is not None:
            log.info("shard %d/%d: %d users loaded from %s", shard, shards, loaded, pinned)
        elif self.writer.meta("states") != pinned:
            log.warning(
                "shard %d/%d serves the states it loaded from %s and the events since; the "
                "manifest names %s (a new store_uri starts from those)",
                shard,
                shards,
                self.writer.meta("states"),
                pinned,
            )
        log.info(
            "shard %d/%d open in %.2f s: %s",
            shard,
            shards,
            time.perf_counter() - t0,
            self.writer.stats(),
        )

    def owns(self, user_id: int) -> bool:
        return user_id % self.shards == self.shard

    def get(self, user_id: int) -> tuple[int, dict] | None:
        """(version, state row) of a user, or None."""
        return self.reads.get(user_id)

    def write(
        self, user_id: int, version: int, row: dict, vid: int, feedback: int, key, answer
    ) -> Write:
        if not self.owns(user_id):
            raise ValueError(f"user {user_id} belongs to shard {user_id % self.shards}")
        return Write(user_id, version, states.pack(row, self.layout), vid, feedback, key, answer)

    def duplicate(self, key: str) -> dict | None:
        """The first answer of the event with idempotency ``key``, if it was applied."""
        return self.reader.answer_of(key)

    def stats(self) -> dict:
        return {"shard": self.shard, **self.reader.stats()}

    def close(self) -> None:
        self.reads.close()
        self.writer.close()


class Committer:
    """Group commit: ``submit`` queues a write and returns once the transaction holding it is
    durable. One task drains the queue: it commits whatever is queued (at most ``max_group``)
    in one transaction on a worker thread, so the event loop keeps serving reads meanwhile, and
    the writes that arrive during that commit make up the next. A lone event is committed at
    once; under load the groups grow with the commit's latency, with no timer to tune."""

    def __init__(self, store: ShardStore, max_group: int = 256) -> None:
        self.store, self.max_group = store, max_group
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def submit(self, write: Write) -> Outcome:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._drain())
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((write, done))
        return await done

    async def _drain(self) -> None:
        while True:
            group = [await self.queue.get()]
            while len(group) < self.max_group and not self.queue.empty():
                group.append(self.queue.get_nowait())
            try:
                outcomes = await asyncio.to_thread(self.store.writer.commit, [w for w, _ in group])
            except Exception as e:  # noqa: BLE001 - every waiting event gets the error
                for _, done in group:
                    if not done.done():
                        done.set_exception(e)
                continue
            for (_, done), outcome in zip(group, outcomes, strict=True):
                if not done.done():
                    done.set_result(outcome)
