"""One shard of the user-state store, without Ray: the states, a write-ahead log, snapshots.

Durability design. A shard owns the users with ``user_id % shards == shard`` and keeps their
state rows in memory. Under ``<store_uri>/shard-<i>/``:

- ``wal/<seq>.json``: one record per acknowledged event - user, item vid, feedback, the
  history length it extends, and the new cached token's per-layer buffers (a few bytes). The
  record is written (and, on local disks, fsynced and renamed into place) BEFORE the event is
  applied in memory and acknowledged, so an acknowledged event survives the replica dying
  right after.
- ``snapshot-<seq>.parquet``: every ``snapshot_every`` events, all of the shard's rows as of
  log position ``seq``; log records up to ``seq`` and older snapshots are then removed.

On start a shard loads its newest snapshot (or, the first time, its users from the published
states), then replays the log records after it, in order. Replay needs no model: a record
carries the token's buffers, not just the event. A record whose base length does not match the
row (already in the snapshot) is skipped, so a crash between snapshot and log cleanup is safe.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time

import numpy as np
import pyarrow as pa

from artifacts import states, storage
from services.engine import Row, append_token

log = logging.getLogger("kvrank.store")


def durable_write(uri: str, data: bytes) -> None:
    """Write ``uri`` so that it is complete and on stable storage when this returns (S3: a PUT
    is atomic and durable once acknowledged; local: temp file, fsync, rename, fsync folder)."""
    if storage.is_remote(uri):
        storage.write_bytes(uri, data)
        return
    folder = os.path.dirname(uri)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{uri}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, uri)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardStore:
    def __init__(
        self,
        manifest_uri: str,
        store_uri: str,
        shard: int,
        shards: int,
        snapshot_every: int = 1000,
    ) -> None:
        self.manifest = storage.read_marker(manifest_uri)
        self.layout = states.Layout.from_manifest(self.manifest)
        self.shard, self.shards, self.snapshot_every = shard, shards, snapshot_every
        self.root = storage.join(store_uri, f"shard-{shard}")
        self.rows: dict[int, Row] = {}
        self.seq = 0  # last log position applied
        self.since_snapshot = 0
        t0 = time.perf_counter()
        snap_seq = self._load(manifest_uri)
        replayed = self._replay(snap_seq)
        log.info(
            "shard %d/%d: %d users from %s, %d log records replayed in %.2f s",
            shard,
            shards,
            len(self.rows),
            f"snapshot {snap_seq}" if snap_seq else "the published states",
            replayed,
            time.perf_counter() - t0,
        )

    # -- start-up

    def _list(self, sub: str) -> list[str]:
        fs, path = storage.filesystem(storage.join(self.root, sub))
        try:
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not n.endswith(".tmp"))

    def _load(self, manifest_uri: str) -> int:
        snaps = [n for n in self._list("") if n.startswith("snapshot-") and n.endswith(".parquet")]
        if snaps:
            table = storage.read_parquet(storage.join(self.root, snaps[-1]))
            seq = int(snaps[-1][len("snapshot-") : -len(".parquet")])
        else:
            parts = []
            for f in self.manifest["state_files"]:
                t = storage.read_table(manifest_uri, f, marker=self.manifest)
                mine = pa.array(t.column("user_id").to_numpy() % self.shards == self.shard)
                parts.append(t.filter(mine))
            table = pa.concat_tables(parts) if parts else states.schema(self.layout).empty_table()
            seq = 0
        for row in table.to_pylist():
            self.rows[int(row["user_id"])] = row
        self.seq = seq
        return seq

    def _replay(self, after: int) -> int:
        n = 0
        for name in self._list("wal"):
            seq = int(name.split(".")[0])
            if seq <= after:
                continue
            rec = json.loads(storage.read_bytes(storage.join(self.root, "wal", name)))
            self._apply(rec)
            self.seq = seq
            n += 1
        return n

    # -- reads and writes

    def owns(self, user_id: int) -> bool:
        return user_id % self.shards == self.shard

    def get(self, user_id: int) -> Row | None:
        return self.rows.get(int(user_id))

    def commit(
        self, user_id: int, before: Row, token: dict[str, bytes], vid: int, feedback: int
    ) -> Row:
        """Log the event durably, then apply it; returns the user's new row."""
        if not self.owns(user_id):
            raise ValueError(f"user {user_id} belongs to shard {user_id % self.shards}")
        rec = {
            "user_id": int(user_id),
            "vid": int(vid),
            "feedback": int(feedback),
            "base_length": int(before["length"]),
            "base": None if int(user_id) in self.rows else _encode(before),
            "token": {c: base64.b64encode(b).decode() for c, b in token.items()},
        }
        seq = self.seq + 1
        durable_write(storage.join(self.root, "wal", f"{seq:012d}.json"), json.dumps(rec).encode())
        row = self._apply(rec)
        self.seq = seq
        self.since_snapshot += 1
        if self.since_snapshot >= self.snapshot_every:
            self.snapshot()
        return row

    def _apply(self, rec: dict) -> Row:
        uid = rec["user_id"]
        row = self.rows.get(uid)
        if row is None:
            row = _decode(rec["base"]) if rec.get("base") else None
            if row is None:
                raise ValueError(f"log record for unknown user {uid} carries no base state")
        if int(row["length"]) != rec["base_length"]:  # already applied (in the snapshot)
            return row
        token = {c: base64.b64decode(b) for c, b in rec["token"].items()}
        self.rows[uid] = append_token(row, token, rec["vid"], rec["feedback"])
        return self.rows[uid]

    def snapshot(self) -> str:
        """All rows as of the current log position; then the log up to it is removed."""
        table = pa.Table.from_pylist(list(self.rows.values()), schema=states.schema(self.layout))
        name = f"snapshot-{self.seq:012d}.parquet"
        durable_write(storage.join(self.root, name), storage.parquet_bytes(table))
        fs, _ = storage.filesystem(self.root)
        for old in self._list(""):
            if old.startswith("snapshot-") and old < name:
                fs.rm(storage.filesystem(storage.join(self.root, old))[1])
        for w in self._list("wal"):
            if int(w.split(".")[0]) <= self.seq:
                fs.rm(storage.filesystem(storage.join(self.root, "wal", w))[1])
        self.since_snapshot = 0
        return name

    def stats(self) -> dict:
        state_bytes = sum(states.row_nbytes(r) for r in self.rows.values())
        return {
            "shard": self.shard,
            "users": len(self.rows),
            "tokens": int(np.sum([r["length"] for r in self.rows.values()])) if self.rows else 0,
            "state_bytes": state_bytes,
            "log_position": self.seq,
        }


def _encode(row: Row) -> dict:
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in row.items()}


def _decode(d: dict) -> Row:
    return {k: base64.b64decode(v) if states.is_state_column(k) else v for k, v in d.items()}
