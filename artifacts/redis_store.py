"""The state store across machines: ``RedisStateStore``, the ``StateStore`` interface on a Redis
(or Valkey) server, for serving replicas that do not share a disk.

The same packed values as the embedded engine (``artifacts.states.pack``), one string per user,
and the same guarantees, each kept by the server:

- Keys. A store shard's keys share one Redis Cluster hash tag, ``<prefix>:{<shard>}:...``: a
  cluster spreads the shards over its nodes, and every key one event touches lies in one slot,
  so an event is one atomic server-side operation on any deployment (one server or a cluster).
  ``u:<user>`` holds the user's state behind a 10-digit version; ``meta`` (a hash) the writer
  epoch, the kept figures and what was loaded; ``events`` (a stream) every applied event -
  user, vid, feedback, time - the durable history since the states were built; ``k:<key>``
  the first answer of the event with that idempotency key.
- ``commit(writes)`` is ONE Lua script call: it checks the writer epoch (fencing), then per
  event the idempotency key (a duplicate returns its first answer), the expected version (a
  conflict stores nothing), and applies it. A group of events shares the call, and with
  ``appendfsync always`` one fsync of the append-only file before the server replies.
- Durability is the server's append-only file: ``fsync`` (``always``, the default, or
  ``everysec``) is set on the server when the store opens for writing, or ``server`` leaves the
  server's own persistence settings as they are (a managed service that refuses ``CONFIG``).
- A server that cannot be reached is ``StoreUnavailable``: the app answers 503, and a client's
  retry with the event's id is applied once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from urllib.parse import parse_qs, urlsplit, urlunsplit

from artifacts.state_store import Fenced, Outcome, StateStore, StoreUnavailable, Write
from models.errors import InputError

log = logging.getLogger("kvrank.redis_store")

SCHEMES = ("redis://", "rediss://")
FSYNC = ("always", "everysec", "server")
VERSION_DIGITS = 10

# KEYS: meta, events, then (user key, idempotency key) per write. ARGV: epoch, time, then per
# write: user id, expected version, state, vid, feedback, keyed (1/0), answer.
COMMIT = """
local epoch = redis.call('HGET', KEYS[1], 'writer_epoch')
if epoch ~= ARGV[1] then
  return redis.error_reply('FENCED ' .. tostring(epoch))
end
local out, users, bytes = {}, 0, 0
for i = 1, (#KEYS - 2) / 2 do
  local ukey, kkey, a = KEYS[1 + 2 * i], KEYS[2 + 2 * i], 2 + (i - 1) * 7
  local keyed, answer = ARGV[a + 6] == '1', ARGV[a + 7]
  local first = keyed and redis.call('GET', kkey)
  if first then
    out[i] = {'duplicate', first, 0}
  else
    local head = redis.call('GETRANGE', ukey, 0, 9)
    local current, old = 0, 0
    if head ~= '' then
      current = tonumber(head)
      old = redis.call('STRLEN', ukey) - 10
    end
    local expected, state = tonumber(ARGV[a + 2]), ARGV[a + 3]
    if current ~= expected then
      out[i] = {'conflict', '', current}
    else
      redis.call('SET', ukey, string.format('%010d', expected + 1) .. state)
      if expected == 0 then users = users + 1 end
      bytes = bytes + #state - old
      redis.call('XADD', KEYS[2], '*', 'user', ARGV[a + 1], 'vid', ARGV[a + 4],
                 'feedback', ARGV[a + 5], 'at', ARGV[2])
      if keyed then redis.call('SET', kkey, answer) end
      out[i] = {'applied', answer, expected + 1}
    end
  end
end
redis.call('HINCRBY', KEYS[1], 'users', users)
redis.call('HINCRBY', KEYS[1], 'packed_bytes', bytes)
return out
"""

# KEYS: meta, then one user key per row. ARGV: epoch, then one state per row. Version 1 each.
LOAD = """
local epoch = redis.call('HGET', KEYS[1], 'writer_epoch')
if epoch ~= ARGV[1] then
  return redis.error_reply('FENCED ' .. tostring(epoch))
end
local bytes = 0
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], '0000000001' .. ARGV[i])
  bytes = bytes + #ARGV[i]
end
redis.call('HINCRBY', KEYS[1], 'users', #KEYS - 1)
redis.call('HINCRBY', KEYS[1], 'packed_bytes', bytes)
return #KEYS - 1
"""


def is_redis(uri: str | None) -> bool:
    return bool(uri) and uri.startswith(SCHEMES)


def _client(url: str, cluster: bool, **kw):
    import redis
    from redis.cluster import RedisCluster

    return RedisCluster.from_url(url, **kw) if cluster else redis.Redis.from_url(url, **kw)


def shards(uri: str) -> list[int]:
    """The shards with keys under ``uri``'s prefix (each has a ``meta`` hash)."""
    import redis

    url, prefix, cluster = parse_uri(uri)
    r = _client(url, cluster)
    try:
        keys = [k.decode() for k in r.scan_iter(match=f"{prefix}:{{*}}:meta", count=1000)]
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"{uri}: {e}") from e
    finally:
        r.close()
    return sorted(int(k[len(prefix) + 2 : k.index("}")]) for k in keys)


def parse_uri(uri: str) -> tuple[str, str, bool]:
    """(server URL for the client, key prefix, cluster) of ``redis[s]://host:port/db`` with the
    optional query ``prefix=`` (default ``kvrank``) and ``cluster=1`` (a Redis Cluster)."""
    parts = urlsplit(uri)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"prefix", "cluster"}
    if unknown:
        raise InputError(f"store_uri {uri}: unknown option(s) {sorted(unknown)}")
    prefix = query.get("prefix", "kvrank")
    if not prefix or any(c in prefix for c in "{} "):
        raise InputError(f"store_uri {uri}: prefix {prefix!r} must be non-empty, without braces")
    cluster = query.get("cluster", "0") in ("1", "true", "yes")
    return urlunsplit(parts._replace(query="")), prefix, cluster


class RedisStateStore(StateStore):
    """One store shard on a Redis server (or cluster). ``writer`` takes the next writer epoch,
    fencing any earlier writer; a reader never writes."""

    def __init__(
        self,
        uri: str,
        shard: int,
        writer: bool = True,
        fsync: str = "always",
        timeout_s: float = 10.0,
    ) -> None:
        if fsync not in FSYNC:
            raise InputError(f"redis fsync {fsync!r}: one of {', '.join(FSYNC)}")
        url, prefix, cluster = parse_uri(uri)
        self.uri, self.shard = uri, shard
        kw = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        self.r = _client(url, cluster, **kw)
        self.base = f"{prefix}:{{{shard}}}:"
        self.meta_key, self.events_key = self.base + "meta", self.base + "events"
        self._commit = self.r.register_script(COMMIT)
        self._load = self.r.register_script(LOAD)
        with self._reachable():
            if writer and fsync != "server":
                self._persist(fsync)
            self.epoch = int(self.r.hincrby(self.meta_key, "writer_epoch", 1)) if writer else None

    def _persist(self, fsync: str) -> None:
        import redis

        try:
            if self.r.config_get("appendonly").get("appendonly") != "yes":
                self.r.config_set("appendonly", "yes")
            self.r.config_set("appendfsync", fsync)
        except redis.ResponseError as e:
            raise InputError(
                f"{self.uri}: the server refused CONFIG ({e}); configure its append-only file "
                "yourself and set redis_fsync to 'server'"
            ) from e

    def _reachable(self):
        """Connection failures and timeouts as ``StoreUnavailable``, a fence as ``Fenced``."""
        import contextlib

        import redis

        @contextlib.contextmanager
        def guard():
            try:
                yield
            except (redis.ConnectionError, redis.TimeoutError) as e:
                raise StoreUnavailable(f"{self.uri}: {e}") from e
            except redis.ResponseError as e:
                if str(e).startswith("FENCED"):
                    newest = str(e).split()[-1]
                    raise Fenced(
                        f"{self.uri} shard {self.shard}: writer epoch {self.epoch} was fenced "
                        f"by a newer writer (epoch {newest}); its events are refused"
                    ) from e
                raise

        return guard()

    def user_key(self, user_id: int) -> str:
        return f"{self.base}u:{int(user_id)}"

    # -- reads

    def get(self, user_ids: Sequence[int]) -> list[tuple[int, bytes] | None]:
        if not user_ids:
            return []
        with self._reachable():
            values = self.r.mget([self.user_key(u) for u in user_ids])
        return [
            None if v is None else (int(v[:VERSION_DIGITS]), bytes(v[VERSION_DIGITS:]))
            for v in values
        ]

    def meta(self, key: str) -> str | None:
        with self._reachable():
            got = self.r.hget(self.meta_key, key)
        return None if got is None else got.decode()

    def answer_of(self, key: str) -> dict | None:
        with self._reachable():
            got = self.r.get(self.base + "k:" + key)
        return None if got is None else json.loads(got)

    def events(self) -> list[tuple[int, int, int, float]]:
        """Every applied event in order: (user, vid, feedback, time), read in pages of 10,000
        (one reply never holds the whole stream)."""
        out, start = [], "-"
        with self._reachable():
            while rows := self.r.xrange(self.events_key, min=start, count=10_000):
                out += [
                    (int(f[b"user"]), int(f[b"vid"]), int(f[b"feedback"]), float(f[b"at"]))
                    for _, f in rows
                ]
                start = "(" + rows[-1][0].decode()  # after the last id read
        return out

    # -- writes

    def _check_writer(self) -> None:
        if self.epoch is None:
            raise Fenced(f"{self.uri} shard {self.shard} is open for reading only")

    def load(self, rows: Iterable[tuple[int, bytes]], meta: dict | None = None) -> int:
        """Bulk-load in calls of 1,000 rows (the fence checked by each), after clearing what an
        unfinished earlier load left."""
        self._check_writer()
        with self._reachable():
            self._clear_users()
            n, batch = 0, []
            for uid, state in rows:
                batch.append((int(uid), state))
                if len(batch) >= 1000:
                    n += self._load_batch(batch)
                    batch = []
            if batch:
                n += self._load_batch(batch)
            if meta:
                self._check_epoch()
                self.r.hset(self.meta_key, mapping={k: str(v) for k, v in meta.items()})
        return n

    def _load_batch(self, batch: list[tuple[int, bytes]]) -> int:
        keys = [self.meta_key, *(self.user_key(u) for u, _ in batch)]
        return int(self._load(keys=keys, args=[self.epoch, *(s for _, s in batch)]))

    def _clear_users(self) -> None:
        if int(self.r.hget(self.meta_key, "users") or 0) == 0:
            return
        log.info("%s shard %d: clearing an unfinished load", self.uri, self.shard)
        for keys in _chunks(self.r.scan_iter(match=self.base + "u:*", count=1000), 1000):
            self.r.unlink(*keys)
        self.r.hset(self.meta_key, mapping={"users": 0, "packed_bytes": 0})

    def _check_epoch(self) -> None:
        newest = int(self.r.hget(self.meta_key, "writer_epoch") or 0)
        if newest != self.epoch:
            raise Fenced(
                f"{self.uri} shard {self.shard}: writer epoch {self.epoch} was fenced by a "
                f"newer writer (epoch {newest}); its events are refused"
            )

    def commit(self, writes: Sequence[Write]) -> list[Outcome]:
        self._check_writer()
        if not writes:
            return []
        keys = [self.meta_key, self.events_key]
        args: list = [self.epoch, repr(time.time())]
        for w in writes:
            keys += [self.user_key(w.user_id), self.base + "k:" + (w.key or "")]
            args += [w.user_id, w.version, w.state, w.vid, w.feedback]
            args += [1 if w.key is not None else 0, json.dumps(w.answer)]
        with self._reachable():
            got = self._commit(keys=keys, args=args)
        out = []
        for status, answer, version in got:
            status = status.decode()
            if status == "conflict":
                out.append(Outcome("conflict"))
            else:
                out.append(Outcome(status, json.loads(answer), int(version)))
        return out

    # -- figures

    def stats(self) -> dict:
        with self._reachable():
            meta = self.r.hgetall(self.meta_key)
            events = self.r.xlen(self.events_key)
        return {
            "users": int(meta.get(b"users", 0)),
            "packed_bytes": int(meta.get(b"packed_bytes", 0)),
            "events": int(events),
            "writer_epoch": self.epoch,
        }

    def close(self) -> None:
        self.r.close()


def _chunks(it, n: int):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch
