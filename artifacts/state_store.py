"""The serving state store: every user's packed state (``artifacts.states.pack``) in a real
storage engine, events applied exactly once and durably, one writer at a time.

``StateStore`` is the interface the Serve deployments use; ``SqliteStateStore`` is the embedded
engine (the default: one machine, ``make serve``, the tests), ``artifacts.redis_store`` the
engine across machines (a Redis or Valkey server), with the same guarantees. SQLite in WAL mode
was chosen over RocksDB (``rocksdict``) and LMDB by a head-to-head run at a million users
(docs/results.md, "The state store"): lookups of 32 users matched RocksDB's (p99 0.46 ms each);
LMDB's were faster, but it maps the file, so the pages lookups touch count in the process's
resident memory (2.2 GB after a million users' lookups, against SQLite's bounded cache at
0.4 GB); RocksDB loads 3x faster and syncs grouped writes 5.7x faster, but SQLite's groups
already pass the events target 4x, it ships with Python (nothing to install or pin), and the
conditional, fenced write, the event history and the idempotency keys are one SQL
transaction.

Durability and exactly-once, per commit (one SQLite transaction, ``synchronous=FULL``):

- ``commit(writes)`` applies a group of events - each a user's new packed state, the version it
  replaces, the event itself (vid, feedback, time) and its idempotency key - in ONE transaction
  with one fsync: the events that arrived while the previous commit ran share it (group commit),
  and each is acknowledged only after it returns.
- A write whose expected version is not the stored one is a conflict: nothing of it is stored.
- An event whose key was committed before is not applied again; its first answer is returned.
- Writers are fenced: opening a store for writing takes the next writer epoch, and every commit
  first checks that its epoch is still the newest. A second live writer (a rolling update, a
  cluster swap) makes the first one's next commit fail with ``Fenced`` - never a silent
  overwrite of what the second acknowledged.
- Every applied event stays in the ``events`` table (the durable history since the states were
  built: user, vid, feedback, time), from which the next build of states can start.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    user_id INTEGER PRIMARY KEY,
    version INTEGER NOT NULL,
    state   BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT UNIQUE,
    user_id  INTEGER NOT NULL,
    vid      INTEGER NOT NULL,
    feedback INTEGER NOT NULL,
    at       REAL NOT NULL,
    answer   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""


class Fenced(RuntimeError):
    """A newer writer has opened this store: this one may no longer acknowledge events."""


class StoreUnavailable(RuntimeError):
    """The engine cannot be reached now (a server down or restarting): nothing of the call was
    acknowledged, and a retry of a keyed event is applied once."""


@dataclass(frozen=True)
class Write:
    """One event: ``user_id``'s state goes from ``version`` (0: no state stored yet) to
    ``state``; ``key`` (or None) makes a retry of it a no-op; ``answer`` is what its client
    is told, stored with it so that a retry gets the same."""

    user_id: int
    version: int
    state: bytes
    vid: int
    feedback: int
    key: str | None
    answer: dict


@dataclass(frozen=True)
class Outcome:
    """What became of one ``Write``: "applied", "duplicate" (its key was applied before:
    ``answer`` is the first answer) or "conflict" (the stored version was another)."""

    status: str
    answer: dict | None = None
    version: int = 0


class StateStore:
    """What the serving deployments need of a state engine: ``SqliteStateStore`` (embedded, the
    default) or ``artifacts.redis_store.RedisStateStore`` (a server); ``open_store`` picks one
    by the store URI."""

    def get(self, user_ids: Sequence[int]) -> list[tuple[int, bytes] | None]:
        """(version, packed state) per user, None for users without one."""
        raise NotImplementedError

    def meta(self, key: str) -> str | None:
        """A recorded figure or fact of the shard (``users``, ``packed_bytes``, ``states``)."""
        raise NotImplementedError

    def answer_of(self, key: str) -> dict | None:
        """The answer the event with idempotency ``key`` got, if it was applied."""
        raise NotImplementedError

    def events(self) -> list[tuple[int, int, int, float]]:
        """Every applied event in order: (user, vid, feedback, time)."""
        raise NotImplementedError

    def commit(self, writes: Sequence[Write]) -> list[Outcome]:
        raise NotImplementedError

    def load(self, rows: Iterable[tuple[int, bytes]], meta: dict | None = None) -> int:
        """Bulk-load (user_id, packed state) rows at version 1, then record ``meta`` (what was
        loaded); returns how many rows. Whatever an unfinished earlier load left is replaced."""
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SqliteStateStore(StateStore):
    """The embedded engine: one SQLite database file per store shard, WAL mode.

    ``cache_mib`` bounds SQLite's page cache (the process's memory for the store, whatever the
    number of users; the OS page cache holds the rest of the file). ``writer`` takes the next
    writer epoch (fencing any earlier writer); a reader (``writer=False``) never writes.
    """

    def __init__(self, path: str, cache_mib: int = 64, writer: bool = True) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        # the store's own thread discipline: one connection, used by one thread at a time (the
        # deployment serialises calls); isolation_level None: transactions are explicit
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        self.db.execute(f"PRAGMA cache_size=-{int(cache_mib) * 1024}")
        self.db.execute("PRAGMA busy_timeout=10000")
        self.db.executescript(SCHEMA)
        self.epoch = self._take_epoch() if writer else None
        # users and packed bytes, kept with every commit: the figures cost no scan
        if self._meta("users") is None and writer:
            users, packed = self.db.execute(
                "SELECT count(*), coalesce(sum(length(state)), 0) FROM users"
            ).fetchone()
            self._set_meta("users", users)
            self._set_meta("packed_bytes", packed)

    # -- fencing

    def _meta(self, key: str) -> str | None:
        got = self.db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return None if got is None else got[0]

    def _set_meta(self, key: str, value) -> None:
        self.db.execute(
            "INSERT INTO meta (k, v) VALUES (?, ?) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
            (key, str(value)),
        )

    def _take_epoch(self) -> int:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            epoch = int(self._meta("writer_epoch") or 0) + 1
            self._set_meta("writer_epoch", epoch)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return epoch

    def _check_epoch(self) -> None:
        if self.epoch is None:
            raise Fenced(f"{self.path} is open for reading only")
        newest = int(self._meta("writer_epoch") or 0)
        if newest != self.epoch:
            raise Fenced(
                f"{self.path}: writer epoch {self.epoch} was fenced by a newer writer "
                f"(epoch {newest}); its events are refused"
            )

    # -- reads

    def get(self, user_ids: Sequence[int]) -> list[tuple[int, bytes] | None]:
        ids = [int(u) for u in user_ids]
        found: dict[int, tuple[int, bytes]] = {}
        for at in range(0, len(ids), 500):  # SQLite's bound-parameter limit
            chunk = ids[at : at + 500]
            marks = ",".join("?" * len(chunk))
            for uid, version, state in self.db.execute(
                f"SELECT user_id, version, state FROM users WHERE user_id IN ({marks})", chunk
            ):
                found[uid] = (version, state)
        return [found.get(u) for u in ids]

    def meta(self, key: str) -> str | None:
        return self._meta(key)

    def answer_of(self, key: str) -> dict | None:
        """The answer the event with idempotency ``key`` got, if it was applied."""
        got = self.db.execute("SELECT answer FROM events WHERE key = ?", (key,)).fetchone()
        return None if got is None else json.loads(got[0])

    def events(self) -> list[tuple[int, int, int, float]]:
        return self.db.execute(
            "SELECT user_id, vid, feedback, at FROM events ORDER BY seq"
        ).fetchall()

    # -- writes

    def load(self, rows: Iterable[tuple[int, bytes]], meta: dict | None = None) -> int:
        """Bulk-load rows (one transaction per 50,000; the fence is checked by each)."""
        n = 0
        batch: list[tuple[int, bytes]] = []
        if int(self._meta("users") or 0):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._check_epoch()
                self.db.execute("DELETE FROM users")
                self.db.execute("UPDATE meta SET v = '0' WHERE k IN ('users', 'packed_bytes')")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

        def flush() -> None:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._check_epoch()
                self.db.executemany(
                    "INSERT INTO users (user_id, version, state) VALUES (?, 1, ?)", batch
                )
                self._count(len(batch), sum(len(s) for _, s in batch))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            batch.clear()

        for uid, state in rows:
            batch.append((int(uid), state))
            n += 1
            if len(batch) >= 50_000:
                flush()
        if batch:
            flush()
        if meta:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._check_epoch()
                for k, v in meta.items():
                    self._set_meta(k, v)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return n

    def commit(self, writes: Sequence[Write]) -> list[Outcome]:
        """Apply ``writes`` in one durable transaction, in order (a later write of the same
        user expects the version an earlier one made)."""
        out: list[Outcome] = []
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self._check_epoch()
            now = time.time()
            for w in writes:
                first = None if w.key is None else self.answer_of(w.key)
                if first is not None:
                    out.append(Outcome("duplicate", first))
                    continue
                if w.version == 0:
                    cur = self.db.execute(
                        "INSERT INTO users (user_id, version, state) VALUES (?, 1, ?) "
                        "ON CONFLICT(user_id) DO NOTHING",
                        (w.user_id, w.state),
                    )
                    grown = (1, len(w.state))
                else:
                    old = self.db.execute(
                        "SELECT length(state) FROM users WHERE user_id = ? AND version = ?",
                        (w.user_id, w.version),
                    ).fetchone()
                    cur = self.db.execute(
                        "UPDATE users SET version = version + 1, state = ? "
                        "WHERE user_id = ? AND version = ?",
                        (w.state, w.user_id, w.version),
                    )
                    grown = (0, len(w.state) - (old[0] if old else 0))
                if cur.rowcount != 1:
                    out.append(Outcome("conflict"))
                    continue
                self._count(*grown)
                self.db.execute(
                    "INSERT INTO events (key, user_id, vid, feedback, at, answer) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (w.key, w.user_id, w.vid, w.feedback, now, json.dumps(w.answer)),
                )
                out.append(Outcome("applied", w.answer, w.version + 1))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return out

    # -- figures

    def _count(self, users: int, packed_bytes: int) -> None:
        """Add to the kept figures (inside the caller's transaction)."""
        self.db.execute("UPDATE meta SET v = CAST(v AS INTEGER) + ? WHERE k = 'users'", (users,))
        self.db.execute(
            "UPDATE meta SET v = CAST(v AS INTEGER) + ? WHERE k = 'packed_bytes'",
            (packed_bytes,),
        )

    def stats(self) -> dict:
        (events,) = self.db.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        return {
            "users": int(self._meta("users") or 0),
            "packed_bytes": int(self._meta("packed_bytes") or 0),
            "events": events,
            "writer_epoch": self.epoch,
        }

    def close(self) -> None:
        self.db.close()


def check_store_uri(uri: str) -> bool:
    """True for a Redis store, False for a local folder; anything else (s3://, ...) is an
    InputError, since neither engine can keep its data there."""
    from artifacts import redis_store, storage
    from models.errors import InputError

    if redis_store.is_redis(uri):
        return True
    if storage.is_remote(uri):
        raise InputError(
            f"store_uri {uri}: give a local folder for the embedded engine (on a cluster, a "
            "persistent volume) or a redis:// server"
        )
    return False


def open_store(
    uri: str,
    shard: int,
    *,
    writer: bool = True,
    cache_mib: int = 64,
    redis_fsync: str = "always",
) -> StateStore:
    """Shard ``shard`` of the store at ``uri``: ``redis[s]://...`` a Redis server or cluster
    (``artifacts.redis_store``), a local folder the embedded engine (``<uri>/shard-<i>.sqlite``).
    """
    from artifacts import redis_store, storage

    if check_store_uri(uri):
        return redis_store.RedisStateStore(uri, shard, writer=writer, fsync=redis_fsync)
    return SqliteStateStore(
        storage.join(uri, f"shard-{shard}.sqlite"), cache_mib=cache_mib, writer=writer
    )


def store_shards(uri: str) -> list[int]:
    """The shards a store holds: its ``shard-<i>.sqlite`` files, or its Redis shards' keys."""
    import re

    from artifacts import redis_store, storage
    from models.errors import InputError

    if redis_store.is_redis(uri):
        return redis_store.shards(uri)
    if storage.is_remote(uri) or not os.path.isdir(uri):
        raise InputError(f"store {uri}: not a local folder of shard databases or a redis:// URI")
    found = (re.fullmatch(r"shard-(\d+)\.sqlite", f) for f in os.listdir(uri))
    return sorted(int(m.group(1)) for m in found if m)


def read_history(uri: str) -> list[tuple[str | None, list[tuple[int, int, int, float]]]]:
    """Per shard of the store at ``uri``: (the states it loaded, every event applied since:
    user, vid, feedback, time) - the durable history the next build of states starts from."""
    from models.errors import InputError

    shards = store_shards(uri)
    if not shards:
        raise InputError(f"store {uri}: no shards found")
    out = []
    for shard in shards:
        store = open_store(uri, shard, writer=False)
        try:
            out.append((store.meta("states"), store.events()))
        finally:
            store.close()
    return out


def shard_rows(manifest_uri: str, shard: int, shards: int):
    """(user_id, packed state) of the published states at ``manifest_uri`` that belong to
    store shard ``shard`` of ``shards`` (``user_id % shards == shard``), file by file."""
    import pyarrow as pa

    from artifacts import states, storage

    manifest = storage.read_marker(manifest_uri)
    layout = states.Layout.from_manifest(manifest)
    for f in manifest["state_files"]:
        t = storage.read_table(manifest_uri, f, marker=manifest)
        mine = pa.array(t.column("user_id").to_numpy() % shards == shard)
        for row in t.filter(mine).to_pylist():
            yield row["user_id"], states.pack(row, layout)


def load_shard(store: StateStore, manifest_uri: str, shard: int, shards: int) -> int | None:
    """Load shard ``shard`` of ``shards`` (``store``, open for writing) with its users of the
    published states at ``manifest_uri``, if it holds none yet: returns how many, or None when
    it already holds states (those it loaded and the events since stay; ``store.meta("states")``
    names them). A shard cut for another number of shards is refused: its users would be
    looked for in the wrong shard and answered as unknown."""
    from artifacts import storage

    check_cut(store, shard, shards)
    if store.meta("states") is not None:
        return None
    pinned = storage.resolve(manifest_uri)
    return store.load(shard_rows(pinned, shard, shards), meta={"states": pinned, "shards": shards})


def check_cut(store: StateStore, shard: int, shards: int) -> None:
    """Refuse a shard loaded for another number of shards than ``shards``."""
    from models.errors import InputError

    cut = store.meta("shards")
    if cut is not None and int(cut) != shards:
        raise InputError(
            f"store shard {shard} was loaded for {cut} shards, not {shards}: serve it with "
            f"shards={cut}, or load the states into a new store_uri"
        )


def is_store(uri: str) -> bool:
    """Whether ``uri`` names a serving store (a redis:// server, or a local folder holding
    shard databases) rather than a published states folder."""
    from artifacts import redis_store, storage

    if redis_store.is_redis(uri):
        return True
    return not storage.is_remote(uri) and os.path.isdir(uri) and bool(store_shards(uri))


def read_served(uri: str, user_ids: Sequence[int]):
    """(the published states the store at ``uri`` was loaded from, the rows of ``user_ids`` as
    the store holds them now, in ``artifacts.states.schema``): what serving answers from, the
    events applied since included. Users the store does not hold have no row. Every shard must
    hold the same states, and all of the shards they were cut into must be there."""
    import numpy as np
    import pyarrow as pa

    from artifacts import states, storage
    from models.errors import InputError

    shards = store_shards(uri)
    if not shards:
        raise InputError(f"store {uri}: no shards found")
    readers = [open_store(uri, s, writer=False) for s in shards]
    try:
        held = {r.meta("states") for r in readers}
        cuts = {r.meta("shards") for r in readers}
        if len(held) != 1 or None in held or len(cuts) != 1:
            raise InputError(
                f"store {uri}: its shards hold {sorted(map(str, held))} cut into "
                f"{sorted(map(str, cuts))} shards; load one version into every shard "
                "(build_user_states --store-uri)"
            )
        cut = int(cuts.pop() or len(shards))
        if shards != list(range(cut)):
            raise InputError(f"store {uri}: was cut into {cut} shards, holds shards {shards}")
        manifest_uri = held.pop()
        layout = states.Layout.from_manifest(storage.read_marker(manifest_uri))
        ids = np.asarray(user_ids, dtype=np.int64)
        rows = []
        for shard, reader in zip(shards, readers, strict=True):
            mine = ids[ids % cut == shard].tolist()
            for at in range(0, len(mine), 4096):
                chunk = mine[at : at + 4096]
                for uid, got in zip(chunk, reader.get(chunk), strict=True):
                    if got is not None:
                        rows.append(states.unpack(uid, got[1], layout))
        return manifest_uri, pa.Table.from_pylist(rows, schema=states.schema(layout))
    finally:
        for r in readers:
            r.close()
