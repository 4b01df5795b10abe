"""The kvrank Serve application: Ingress -> UserStateStore shards and Ranker replicas.

    serve run services.app:build_app manifest_uri=out/user_states/ml-latest-small-ckv
    serve run infra/serve_config.yaml           # the same, with every setting spelled out

Everything is loaded from ONE manifest (a ``build_user_states`` output): it names the dataset
(item ids), the item vectors, the CollectiveKV checkpoint and the stored states.

- ``Ingress`` (FastAPI): validates requests, maps item ids to vids, routes a user to their
  store shard and the candidates to a ranker replica. OpenAPI at ``/docs``.
- ``UserStateStore<i>``: the compressed states of the users with ``user_id % shards == i`` in
  a state engine (``artifacts.state_store``: embedded SQLite by default, or Redis), one replica
  each. An event becomes one more cached token (the ranker's ``extend``), is committed durably
  (with the events that arrived during the previous commit: group commit) and only then
  acknowledged; an event with an ``event_id`` is applied once however often it is sent
  (``services.store``).
- ``Ranker``: model, item table and pools on its device; ``@serve.batch`` gathers concurrent
  requests and scores them in one expand + MIS forward. Stateless, autoscaled.

Between deployments travel ids and state rows (a few bytes per history item and layer), never
expanded K/V.
"""

# no "from __future__ import annotations": FastAPI resolves the route annotations at runtime

import asyncio
import dataclasses
import logging
import os
import threading
import time

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.metrics import Counter, Gauge, Histogram

from artifacts.states import row_nbytes
from services import auth
from services.api import (
    ID_MAX,
    EventRequest,
    EventResponse,
    RankRequest,
    RankResponse,
    RecommendRequest,
    ScoredItem,
    UserResponse,
    bad_request,
)
from services.settings import ServeSettings

log = logging.getLogger("kvrank.serve")

BODY_LIMIT_ENV = "KVRANK_MAX_BODY_BYTES"
TOKENS_ENV = "KVRANK_API_TOKENS_FILE"


async def answer(call, retry_after_s: int):
    """Await a deployment call; its queue full (Serve's BackPressureError), a store replica
    fenced by a newer one (a rollout in progress) or a store server out of reach (a Redis
    restart) becomes 503 with Retry-After instead of a 500: the client retries and reaches a
    replica that serves."""
    from ray.serve.exceptions import BackPressureError

    from artifacts.state_store import Fenced, StoreUnavailable

    try:
        return await call
    except (BackPressureError, Fenced, StoreUnavailable) as e:
        raise HTTPException(
            status_code=503,
            detail="overloaded: try again later",
            headers={"Retry-After": str(retry_after_s)},
        ) from e


class Catalog:
    """The served catalog: item ids <-> vids (the dataset the manifest names), and the
    response for a ranked list of vids."""

    def __init__(self, ids: np.ndarray, vids: np.ndarray, feedback_classes: int) -> None:
        self.vid_of = dict(zip(ids.tolist(), vids.tolist(), strict=True))
        self.item_of = np.empty(len(ids), dtype=np.int64)
        self.item_of[vids] = ids
        self.feedback_classes = feedback_classes

    @classmethod
    def load(cls, manifest_uri: str) -> "Catalog":
        from artifacts import storage
        from models.config import RankerConfig

        manifest = storage.read_marker(manifest_uri)
        items = storage.read_table(
            manifest["dataset_uri"], "items.parquet", columns=["item_id", "vid"]
        )
        rc = RankerConfig.from_json(storage.read_file(manifest["checkpoint"], "ranker.json"))
        return cls(
            items.column("item_id").to_numpy(), items.column("vid").to_numpy(), rc.feedback_classes
        )

    def vids(self, field: str, item_ids: list[int], skip_unknown: bool = False):
        """(vids of the known ids, the unknown ids); unknown ids fail the request unless
        ``skip_unknown`` (and then at least one must be known)."""
        unknown = [i for i in item_ids if i not in self.vid_of]
        if unknown and (not skip_unknown or len(unknown) == len(item_ids)):
            raise bad_request(field, f"unknown item id(s): {unknown[:10]}")
        return [self.vid_of[i] for i in item_ids if i in self.vid_of], unknown

    def check_feedback(self, feedback: int) -> None:
        if feedback >= self.feedback_classes:
            raise bad_request(
                "feedback",
                f"feedback is -1 (unknown) or a class 0..{self.feedback_classes - 1}, "
                f"got {feedback}",
            )

    def response(
        self,
        user_id: int,
        row: dict,
        known: bool,
        top_vids: list[int],
        scores: list[float],
        unknown: list[int],
    ) -> RankResponse:
        return RankResponse(
            user_id=user_id,
            known_user=known,
            history_length=len(row["hist"]),
            items=[
                ScoredItem(item_id=int(self.item_of[v]), score=s)
                for v, s in zip(top_vids, scores, strict=True)
            ],
            unknown_item_ids=unknown,
            note=None if known else "unknown user: ranked from an empty history",
        )


# ----------------------------------------------------------------------------- deployments


@serve.deployment
class Ranker:
    def __init__(self, settings: dict) -> None:
        import torch

        from services.engine import RankEngine

        s = ServeSettings(**settings)
        torch.set_num_threads(s.torch_threads)
        device = "cuda" if s.ranker_num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.engine = RankEngine(
            s.manifest_uri,
            device=device,
            item_prior_uri=s.item_prior_uri,
            item_prior_weight=s.item_prior_weight,
            slack_items=s.state_slack_items,
            follow_vectors=s.item_vectors_poll_s > 0,
        )
        if s.item_vectors_poll_s > 0:
            threading.Thread(
                target=self._follow_vectors, args=(s.item_vectors_poll_s,), daemon=True
            ).start()
        self.retrieve = s.recommend_candidates
        for batched in (self.rank, self.recommend):
            batched.set_max_batch_size(s.batch_max_size)
            batched.set_batch_wait_timeout_s(s.batch_wait_timeout_s)
        self.scored = Counter("kvrank_candidates_scored", description="candidate scores computed")
        self.batch_size = Histogram(
            "kvrank_batch_size",
            description="requests per ranker forward pass",
            boundaries=[1, 2, 4, 8, 16, 32, 64],
        )
        self.seconds = Histogram(
            "kvrank_rank_seconds",
            description="seconds per batch: expand the states and score (MIS)",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
            tag_keys=("stage",),
        )

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def rank(self, requests: list[tuple[dict, list[int], int]]) -> list:
        rows, cands, ks = zip(*requests, strict=True)
        # the forward runs on a worker thread: the replica's event loop keeps taking requests
        # (the next batch fills while this one is scored; one batch runs at a time)
        out = await asyncio.to_thread(self.engine.rank, list(rows), list(cands), list(ks))
        t = self.engine.last_timings
        self.batch_size.observe(len(requests))
        self.seconds.observe(t["expand_s"], tags={"stage": "expand"})
        self.seconds.observe(t["score_s"], tags={"stage": "score"})
        self.scored.inc(sum(len(c) for c in cands))
        return out

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def recommend(self, requests: list[tuple[dict, int, bool]]) -> list:
        rows, ks, exclude = zip(*requests, strict=True)
        return await asyncio.to_thread(
            self.engine.recommend, list(rows), list(ks), self.retrieve, list(exclude)
        )

    def _follow_vectors(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            try:
                newest = self.engine.follow_vectors()
            except Exception as e:  # a version that does not fit: keep serving the last one
                log.warning("item vectors not followed, %s still served: %s", self.vectors(), e)
                continue
            if newest:
                log.info("item table now from %s", newest)

    def vectors(self) -> str | None:
        """The item vectors this replica scores with."""
        return self.engine.vectors_uri

    def extend(self, row: dict, vid: int, feedback: int) -> dict:
        return self.engine.extend(row, vid, feedback)

    def empty_state(self, user_id: int) -> dict:
        return self.engine.empty_state(user_id)


@serve.deployment
class UserStateStore:
    def __init__(self, settings: dict, shard: int, ranker) -> None:
        from services.store import Committer, ShardStore

        s = ServeSettings(**settings)
        self.store = ShardStore(
            s.manifest_uri,
            s.resolved_store_uri(),
            shard,
            s.shards,
            s.store_cache_mib,
            s.redis_fsync,
        )
        self.commits = Committer(self.store)
        self.ranker = ranker
        self.locks: dict[
            int, list
        ] = {}  # user -> [lock, holders]: only users with events in flight
        self.size = Gauge(
            "kvrank_store_state_bytes",
            description="packed bytes of state (and history ids) in the shard",
            tag_keys=("shard",),
        )
        self.shard = shard
        self.gauged = 0.0
        self._gauge()

    def _gauge(self) -> None:
        # the kept figure (one meta row or field), not the full stats
        self.gauged = time.monotonic()
        packed = int(self.store.reader.meta("packed_bytes") or 0)
        self.size.set(packed, tags={"shard": str(self.shard)})

    async def get(self, user_id: int) -> dict | None:
        # the engine's reads block (a disk, or a server's round trip): off the event loop
        got = await asyncio.to_thread(self.store.get, user_id)
        return None if got is None else got[1]

    async def append(self, user_id: int, vid: int, feedback: int, key: str | None = None) -> dict:
        from artifacts.state_store import Fenced

        held = self.locks.setdefault(user_id, [asyncio.Lock(), 0])
        held[1] += 1
        try:
            async with held[0]:  # one user's events apply in order
                first = None if key is None else await asyncio.to_thread(self.store.duplicate, key)
                if first is not None:
                    return first | {"duplicate": True}
                got = await asyncio.to_thread(self.store.get, user_id)
                if got is None:
                    version, before = 0, await self.ranker.empty_state.remote(user_id)
                else:
                    version, before = got
                after = await self.ranker.extend.remote(before, vid, feedback)
                answer = {"history_length": len(after["hist"]), "state_bytes": row_nbytes(after)}
                write = self.store.write(user_id, version, after, vid, feedback, key, answer)
                outcome = await self.commits.submit(write)
        finally:
            held[1] -= 1
            if held[1] == 0:
                del self.locks[user_id]
        if outcome.status == "conflict":  # only another writer can have changed the user
            raise Fenced(f"user {user_id} was changed by another writer of shard {self.shard}")
        if time.monotonic() - self.gauged >= 1.0:  # at most once a second
            await asyncio.to_thread(self._gauge)
        return outcome.answer | {"duplicate": outcome.status == "duplicate"}

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.store.stats)


app = FastAPI(
    title="kvrank",
    description="Rank candidates for a user from their compressed (CollectiveKV) state.",
    version="1",
)


@app.middleware("http")
async def limit_body(request: Request, call_next):
    """Refuse bodies over the configured size before parsing them (413)."""
    # Serve pickles ``app`` into the replica, so the setting arrives as the replica's env var
    limit = int(os.environ.get(BODY_LIMIT_ENV, 1 << 20))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return JSONResponse(status_code=413, content={"detail": f"request body over {limit} bytes"})
    if request.method == "POST" and len(await request.body()) > limit:
        return JSONResponse(status_code=413, content={"detail": f"request body over {limit} bytes"})
    return await call_next(request)


_tokens: dict[str, auth.Tokens] = {}  # per tokens file, in this replica


@app.middleware("http")
async def authorize(request: Request, call_next):
    """With a tokens file (api_tokens_file), every /v1/ route wants a bearer token with its
    scope (services.auth): 401 without a valid one, 403 without the scope; bodies say no more."""
    path = os.environ.get(TOKENS_ENV)
    need = auth.scope_of(request.url.path, request.scope.get("root_path", "")) if path else None
    if need is None:
        return await call_next(request)
    tokens = _tokens.get(path) or _tokens.setdefault(path, auth.Tokens(path))
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    held = tokens.scopes(token.strip()) if scheme.lower() == "bearer" and token else None
    if held is None:
        return JSONResponse(
            status_code=401,
            content={"detail": "unauthorized"},
            headers={"WWW-Authenticate": "Bearer"},
        )
    if need not in held[0]:
        return JSONResponse(status_code=403, content={"detail": "forbidden"})
    return await call_next(request)


def serve_http_host() -> str:
    """The host Serve's HTTP proxies listen on (http_options.host)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().http_config.host


NOT_LOADED = object()  # a shard the ingress cannot read itself (yet): its deployment answers


# The ingress's constructor checks the settings (exposure, tokens, the manifest): a refusal is
# the same on every try, so the deployment fails after three (Serve's default is 20, each a new
# replica process) and `serve status` says why sooner; a storage blip still gets its retries.
@serve.deployment(max_constructor_retry_count=3)
@serve.ingress(app)
class Ingress:
    def __init__(self, settings: dict, ranker, *stores) -> None:
        from artifacts import states, storage

        self.s = ServeSettings(**settings)
        auth.check_exposure(serve_http_host(), self.s.api_tokens_file)
        if self.s.api_tokens_file:
            _tokens[self.s.api_tokens_file] = auth.Tokens(self.s.api_tokens_file)  # or refuse
        self.catalog = Catalog.load(self.s.manifest_uri)
        self.ranker = ranker
        self.stores = list(stores)
        # state reads go straight to the engine (services.store.ShardReader), once a shard's
        # writer has loaded it; events still go through the shard's deployment (one writer)
        self.layout = states.Layout.from_manifest(storage.read_marker(self.s.manifest_uri))
        self.store_uri = self.s.resolved_store_uri()
        self.readers: dict = {}
        self.readers_lock = threading.Lock()
        self.counts = {
            "rank_requests": 0,
            "recommend_requests": 0,
            "candidates": 0,
            "events": 0,
            "rejected": 0,
        }
        self.started = time.time()

    def _bad(self, field: str, message: str) -> HTTPException:
        self.counts["rejected"] += 1
        return bad_request(field, message)

    def _vids(self, field: str, item_ids: list[int], skip_unknown: bool = False):
        try:
            return self.catalog.vids(field, item_ids, skip_unknown)
        except HTTPException:
            self.counts["rejected"] += 1
            raise

    def _store(self, user_id: int):
        return self.stores[user_id % len(self.stores)]

    @app.get("/healthz")
    def healthz(self) -> dict:
        return {"status": "ok"}

    @app.post("/v1/rank", response_model=RankResponse)
    async def rank(self, req: RankRequest) -> RankResponse:
        self._check(req)
        vids, unknown = self._vids("candidate_item_ids", req.candidate_item_ids, req.skip_unknown)
        row, known = await self._row(req.user_id)
        top_vids, scores = await answer(
            self.ranker.rank.remote((row, vids, req.k)), self.s.retry_after_s
        )
        self.counts["rank_requests"] += 1
        self.counts["candidates"] += len(vids)
        return self.catalog.response(req.user_id, row, known, top_vids, scores, unknown)

    @app.post("/v1/recommend", response_model=RankResponse)
    async def recommend(self, req: RecommendRequest) -> RankResponse:
        """The user's best k items of the whole catalog: the ``recommend_candidates`` items
        the user vector (and the prior) retrieve, ranked with the full score."""
        if req.k > self.s.max_k:
            raise self._bad("k", f"k must be at most {self.s.max_k}, got {req.k}")
        row, known = await self._row(req.user_id)
        top_vids, scores = await answer(
            self.ranker.recommend.remote((row, req.k, req.exclude_seen)), self.s.retry_after_s
        )
        self.counts["recommend_requests"] += 1
        return self.catalog.response(req.user_id, row, known, top_vids, scores, [])

    def _check(self, req: RankRequest) -> None:
        n = len(req.candidate_item_ids)
        if n > self.s.max_candidates:
            raise self._bad(
                "candidate_item_ids", f"{n} candidates, at most {self.s.max_candidates}"
            )
        if len(set(req.candidate_item_ids)) != n:
            raise self._bad("candidate_item_ids", "candidate ids must be distinct")
        if req.k > self.s.max_k:
            raise self._bad("k", f"k must be at most {self.s.max_k}, got {req.k}")

    def _read(self, user_id: int):
        """The user's (version, row) or None from the shard's reader; NOT_LOADED while the
        shard cannot be read from here (its writer has not finished its first load, or an
        embedded shard lives on another machine): asked again a second later. Blocking: call
        it off the event loop."""
        from services.store import ShardReader

        shard = user_id % len(self.stores)
        with self.readers_lock:
            reader = self.readers.get(shard)
            if reader is None or (isinstance(reader, float) and reader <= time.monotonic()):
                reader = ShardReader.open_loaded(
                    self.store_uri,
                    shard,
                    self.layout,
                    cache_mib=self.s.store_cache_mib,
                    redis_fsync=self.s.redis_fsync,
                )
                self.readers[shard] = reader or time.monotonic() + 1.0
            if reader is None or isinstance(reader, float):
                return NOT_LOADED
        return reader.get(user_id)

    async def _row(self, user_id: int) -> tuple[dict, bool]:
        """The user's stored state row, or an empty one (and False) for an unknown user."""
        got = await asyncio.to_thread(self._read, user_id)
        if got is NOT_LOADED:
            row = await self._store(user_id).get.remote(user_id)
        else:
            row = None if got is None else got[1]
        if row is not None:
            return row, True
        return await self.ranker.empty_state.remote(user_id), False

    @app.post("/v1/events", response_model=EventResponse)
    async def events(self, req: EventRequest) -> EventResponse:
        (vid,), _ = self._vids("item_id", [req.item_id])
        try:
            self.catalog.check_feedback(req.feedback)
        except HTTPException:
            self.counts["rejected"] += 1
            raise
        done = await answer(
            self._store(req.user_id).append.remote(req.user_id, vid, req.feedback, req.event_id),
            self.s.retry_after_s,
        )
        self.counts["events"] += 1
        return EventResponse(user_id=req.user_id, **done)

    @app.get("/v1/users/{user_id}", response_model=UserResponse)
    async def user(self, user_id: int) -> UserResponse:
        if not 0 <= user_id <= ID_MAX:
            raise self._bad("user_id", f"user ids are 0..{ID_MAX} (int64)")
        row = await self._store(user_id).get.remote(user_id)
        return UserResponse(
            user_id=user_id,
            known_user=row is not None,
            history_length=len(row["hist"]) if row else 0,
            state_bytes=row_nbytes(row) if row else 0,
        )

    @app.get("/v1/stats")
    async def stats(self) -> dict:
        shards = await asyncio.gather(*(s.stats.remote() for s in self.stores))
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "feedback_classes": self.catalog.feedback_classes,
            "ingress": dict(self.counts),
            "item_vectors": await self.ranker.vectors.remote(),  # of one Ranker replica
            "store": {
                "shards": shards,
                "users": sum(s["users"] for s in shards),
                "packed_bytes": sum(s["packed_bytes"] for s in shards),
                "events": sum(s["events"] for s in shards),
            },
        }


def build_app(args: dict):
    """The application for ``serve run`` / ``serve deploy``: ``args`` are ServeSettings fields."""
    s = ServeSettings.from_args(args).pinned()
    conf = dataclasses.asdict(s)
    ranker = Ranker.options(
        autoscaling_config={
            "min_replicas": s.ranker_min_replicas,
            "max_replicas": s.ranker_max_replicas,
            "target_ongoing_requests": s.ranker_target_ongoing_requests,
            "upscale_delay_s": s.ranker_upscale_delay_s,
            "downscale_delay_s": s.ranker_downscale_delay_s,
        },
        max_ongoing_requests=s.ranker_max_ongoing_requests,
        max_queued_requests=s.ranker_max_queued_requests,
        health_check_period_s=s.health_check_period_s,
        ray_actor_options={"num_cpus": s.ranker_num_cpus, "num_gpus": s.ranker_num_gpus},
    ).bind(conf)
    stores = [
        UserStateStore.options(
            name=f"UserStateStore{i}",
            num_replicas=1,
            max_ongoing_requests=s.store_max_ongoing_requests,
            health_check_period_s=s.health_check_period_s,
            ray_actor_options={"num_cpus": s.store_num_cpus},
        ).bind(conf, i, ranker)
        for i in range(s.shards)
    ]
    # Serve pickles ``app`` into the replica: its middleware reads these settings from the env
    env = {BODY_LIMIT_ENV: str(s.max_body_bytes)}
    if s.api_tokens_file:
        env[TOKENS_ENV] = s.api_tokens_file
    return Ingress.options(
        max_ongoing_requests=s.ingress_max_ongoing_requests,
        max_queued_requests=s.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=s.retry_after_s),
        health_check_period_s=s.health_check_period_s,
        ray_actor_options={
            "num_cpus": s.ingress_num_cpus,
            "runtime_env": {"env_vars": env},
        },
    ).bind(conf, ranker, *stores)
