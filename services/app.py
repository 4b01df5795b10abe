"""The kvrank Serve application: Ingress -> UserStateStore shards and Ranker replicas.

    serve run services.app:build_app manifest_uri=out/user_states/ml-latest-small-ckv
    serve run infra/serve_config.yaml           # the same, with every setting spelled out

Everything is loaded from ONE manifest (a ``build_user_states`` output): it names the dataset
(item ids), the item vectors, the CollectiveKV checkpoint and the stored states.

- ``Ingress`` (FastAPI): validates requests, maps item ids to vids, routes a user to their
  store shard and the candidates to a ranker replica. OpenAPI at ``/docs``.
- ``UserStateStore<i>``: the compressed states of the users with ``user_id % shards == i``; one
  replica each. An event becomes one more cached token (the ranker's ``extend``), is written to
  the shard's log and only then acknowledged (``services.store`` documents the log, snapshots
  and replay).
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
import time
from collections import defaultdict

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from artifacts.states import row_nbytes
from services.settings import ServeSettings

log = logging.getLogger("kvrank.serve")

BODY_LIMIT_ENV = "KVRANK_MAX_BODY_BYTES"

# ----------------------------------------------------------------------------- HTTP schema


class RankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt = Field(ge=0, description="a user id; unknown users rank from no history")
    candidate_item_ids: list[StrictInt] = Field(min_length=1, description="distinct item ids")
    k: StrictInt = Field(default=10, ge=1, description="how many of the best to return")


class ScoredItem(BaseModel):
    item_id: int
    score: float


class RankResponse(BaseModel):
    user_id: int
    known_user: bool
    history_length: int
    items: list[ScoredItem]
    note: str | None = None


class EventRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt = Field(ge=0)
    item_id: StrictInt
    feedback: StrictInt = Field(default=-1, ge=-1, description="feedback class, -1 unknown")


class EventResponse(BaseModel):
    user_id: int
    history_length: int
    state_bytes: int
    acknowledged: bool = True


class UserResponse(BaseModel):
    user_id: int
    known_user: bool
    history_length: int
    state_bytes: int


def bad_request(field: str, message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": message}])


class Catalog:
    """The served catalog: item ids <-> vids (the dataset the manifest names), and the
    response for a ranked list of vids."""

    def __init__(self, ids: np.ndarray, vids: np.ndarray) -> None:
        self.vid_of = dict(zip(ids.tolist(), vids.tolist(), strict=True))
        self.item_of = np.empty(len(ids), dtype=np.int64)
        self.item_of[vids] = ids

    @classmethod
    def load(cls, manifest_uri: str) -> "Catalog":
        from artifacts import storage

        manifest = storage.read_marker(manifest_uri)
        items = storage.read_table(
            manifest["dataset_uri"], "items.parquet", columns=["item_id", "vid"]
        )
        return cls(items.column("item_id").to_numpy(), items.column("vid").to_numpy())

    def vids(self, field: str, item_ids: list[int]) -> list[int]:
        unknown = [i for i in item_ids if i not in self.vid_of]
        if unknown:
            raise bad_request(field, f"unknown item id(s): {unknown[:10]}")
        return [self.vid_of[i] for i in item_ids]

    def response(
        self, user_id: int, row: dict, known: bool, top_vids: list[int], scores: list[float]
    ) -> RankResponse:
        return RankResponse(
            user_id=user_id,
            known_user=known,
            history_length=len(row["hist"]),
            items=[
                ScoredItem(item_id=int(self.item_of[v]), score=s)
                for v, s in zip(top_vids, scores, strict=True)
            ],
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
        )
        self.rank.set_max_batch_size(s.batch_max_size)
        self.rank.set_batch_wait_timeout_s(s.batch_wait_timeout_s)
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
        out = self.engine.rank(list(rows), list(cands), list(ks))
        t = self.engine.last_timings
        self.batch_size.observe(len(requests))
        self.seconds.observe(t["expand_s"], tags={"stage": "expand"})
        self.seconds.observe(t["score_s"], tags={"stage": "score"})
        self.scored.inc(sum(len(c) for c in cands))
        return out

    def extend(self, row: dict, vid: int, feedback: int) -> dict:
        return self.engine.extend(row, vid, feedback)

    def empty_state(self, user_id: int) -> dict:
        return self.engine.empty_state(user_id)


@serve.deployment
class UserStateStore:
    def __init__(self, settings: dict, shard: int, ranker) -> None:
        from services.store import ShardStore

        s = ServeSettings(**settings)
        self.store = ShardStore(
            s.manifest_uri, s.resolved_store_uri(), shard, s.shards, s.snapshot_every
        )
        self.ranker = ranker
        self.locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.size = Gauge(
            "kvrank_store_state_bytes",
            description="bytes of compressed state in the shard",
            tag_keys=("shard",),
        )
        self.size.set(self.store.stats()["state_bytes"], tags={"shard": str(shard)})
        self.shard = shard

    def get(self, user_id: int) -> dict | None:
        return self.store.get(user_id)

    async def append(self, user_id: int, vid: int, feedback: int) -> dict:
        from services.engine import token_of

        async with self.locks[user_id]:  # one user's events apply in order
            before = self.store.get(user_id)
            if before is None:
                before = await self.ranker.empty_state.remote(user_id)
            after = await self.ranker.extend.remote(before, vid, feedback)
            row = self.store.commit(user_id, before, token_of(before, after), vid, feedback)
        self.size.set(self.store.stats()["state_bytes"], tags={"shard": str(self.shard)})
        return {"history_length": len(row["hist"]), "state_bytes": row_nbytes(row)}

    def stats(self) -> dict:
        return self.store.stats()


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


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, settings: dict, ranker, *stores) -> None:
        self.s = ServeSettings(**settings)
        self.catalog = Catalog.load(self.s.manifest_uri)
        self.ranker = ranker
        self.stores = list(stores)
        self.counts = {"rank_requests": 0, "candidates": 0, "events": 0, "rejected": 0}
        self.started = time.time()

    def _bad(self, field: str, message: str) -> HTTPException:
        self.counts["rejected"] += 1
        return bad_request(field, message)

    def _vids(self, field: str, item_ids: list[int]) -> list[int]:
        try:
            return self.catalog.vids(field, item_ids)
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
        vids = self._vids("candidate_item_ids", req.candidate_item_ids)
        row, known = await self._row(req.user_id)
        top_vids, scores = await self.ranker.rank.remote((row, vids, req.k))
        self.counts["rank_requests"] += 1
        self.counts["candidates"] += len(vids)
        return self.catalog.response(req.user_id, row, known, top_vids, scores)

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

    async def _row(self, user_id: int) -> tuple[dict, bool]:
        """The user's stored state row, or an empty one (and False) for an unknown user."""
        row = await self._store(user_id).get.remote(user_id)
        if row is not None:
            return row, True
        return await self.ranker.empty_state.remote(user_id), False

    @app.post("/v1/events", response_model=EventResponse)
    async def events(self, req: EventRequest) -> EventResponse:
        (vid,) = self._vids("item_id", [req.item_id])
        done = await self._store(req.user_id).append.remote(req.user_id, vid, req.feedback)
        self.counts["events"] += 1
        return EventResponse(user_id=req.user_id, **done)

    @app.get("/v1/users/{user_id}", response_model=UserResponse)
    async def user(self, user_id: int) -> UserResponse:
        if user_id < 0:
            raise self._bad("user_id", "user ids are >= 0")
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
            "ingress": dict(self.counts),
            "store": {
                "shards": shards,
                "users": sum(s["users"] for s in shards),
                "state_bytes": sum(s["state_bytes"] for s in shards),
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
        },
        max_ongoing_requests=s.ranker_max_ongoing_requests,
        ray_actor_options={"num_cpus": s.ranker_num_cpus, "num_gpus": s.ranker_num_gpus},
    ).bind(conf)
    stores = [
        UserStateStore.options(
            name=f"UserStateStore{i}",
            num_replicas=1,
            max_ongoing_requests=s.store_max_ongoing_requests,
            ray_actor_options={"num_cpus": s.store_num_cpus},
        ).bind(conf, i, ranker)
        for i in range(s.shards)
    ]
    return Ingress.options(
        max_ongoing_requests=s.ingress_max_ongoing_requests,
        ray_actor_options={
            "num_cpus": s.ingress_num_cpus,
            "runtime_env": {"env_vars": {BODY_LIMIT_ENV: str(s.max_body_bytes)}},
        },
    ).bind(conf, ranker, *stores)
