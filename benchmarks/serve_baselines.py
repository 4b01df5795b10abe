"""The rankers kvrank's Serve app is measured against, as a second Serve application beside it
(benchmarks only; the production app in ``services.app`` knows nothing of them):

- ``POST /baselines/v1/rank_full``: the same model, every candidate scored by its own full
  forward over the user's history plus itself (no KV reuse: what MIS saves);
- ``POST /baselines/v1/rank_teacher``: the full-text teacher (``train_teacher``) on vLLM's
  async engine, one prompt per candidate, a user's prompts sharing the cached history prefix -
  the standard way a text reranker is served, which DuoLM's ranker is measured against.

The requests and answers are ``/v1/rank``'s. User states come from the running production
app's store shards (Serve handles by name), so both apps rank the same users from the same
state.
"""

# no "from __future__ import annotations": FastAPI resolves the route annotations at runtime

import numpy as np
import torch
from fastapi import FastAPI, HTTPException
from ray import serve

from artifacts import storage
from services.api import RankRequest, RankResponse
from services.app import Catalog

APP_NAME = "baselines"
ROUTE_PREFIX = "/baselines"


@torch.no_grad()
def rank_full(engine, row: dict, cands: list[int], k: int, chunk: int = 64):
    """(vids, scores) of the top ``k`` of ``cands`` for one user, each candidate by its own full
    forward (the dense reference path), ``chunk`` sequences at a time. Same model and the same
    scores as ``RankEngine.rank`` up to float rounding; only the cost differs."""
    from models.batches import history_batch
    from models.inputs import History

    hist = np.asarray(row["hist"], dtype=np.int64)[-engine.max_len :]
    fb = np.asarray(row["hist_fb"], dtype=np.int64)[-engine.max_len :]
    h = history_batch([hist], [fb], engine.max_len)
    dev = engine.device
    scores = []
    for i in range(0, len(cands), chunk):
        c = torch.as_tensor(cands[i : i + chunk], dtype=torch.long, device=dev)
        rep = History(
            h.vids.to(dev).expand(len(c), -1),
            h.feedback.to(dev).expand(len(c), -1),
            h.lengths.to(dev).expand(len(c)),
        )
        scores.append(engine.model.score_reference(rep, c[:, None])[:, 0].float().cpu())
    s = torch.cat(scores)
    top = torch.topk(s, min(k, len(cands)))
    return [cands[i] for i in top.indices.tolist()], top.values.tolist()


@serve.deployment
class FullForwardRanker:
    def __init__(self, manifest_uri: str, torch_threads: int = 1) -> None:
        from services.engine import RankEngine

        torch.set_num_threads(torch_threads)
        self.engine = RankEngine(manifest_uri)

    def rank(self, request: tuple[dict, list[int], int]):
        return rank_full(self.engine, *request)


@serve.deployment
class TeacherRanker:
    """The teacher on vLLM's async engine: a user's candidates as prompts over the titles of
    ``dataset_uri``'s catalog."""

    def __init__(self, dataset_uri: str, teacher_uri: str) -> None:
        from artifacts.data import item_titles
        from pipelines.common.teachers import load_teacher

        self.titles = item_titles(dataset_uri)
        with load_teacher(teacher_uri, "vllm", serving=True) as teacher:
            self.teacher = teacher

    async def rank(self, request: tuple[dict, list[int], int]):
        from models.teacher import TeacherExample

        row, cands, k = request
        hist = [self.titles[v] for v in row["hist"]]
        fb = [int(f) for f in row["hist_fb"]]
        examples = [TeacherExample(hist, fb, self.titles[c]) for c in cands]
        scores = await self.teacher.score(examples)
        top = np.argsort(-scores, kind="stable")[:k]
        return [cands[i] for i in top], [float(scores[i]) for i in top]


api = FastAPI(title="kvrank baselines (benchmarks only)")


@serve.deployment
@serve.ingress(api)
class BaselinesIngress:
    def __init__(self, manifest_uri: str, shards: int, app_name: str, full, teacher) -> None:
        self.catalog = Catalog.load(manifest_uri)
        self.stores = [
            serve.get_deployment_handle(f"UserStateStore{i}", app_name) for i in range(shards)
        ]
        self.ranker = serve.get_deployment_handle("Ranker", app_name)
        self.full, self.teacher = full, teacher

    async def _rank(self, req: RankRequest, ranker) -> RankResponse:
        if ranker is None:
            raise HTTPException(status_code=404, detail="this baseline is not deployed")
        vids, unknown = self.catalog.vids(
            "candidate_item_ids", req.candidate_item_ids, req.skip_unknown
        )
        row = await self.stores[req.user_id % len(self.stores)].get.remote(req.user_id)
        known = row is not None
        if not known:
            row = await self.ranker.empty_state.remote(req.user_id)
        top, scores = await ranker.rank.remote((row, vids, req.k))
        return self.catalog.response(req.user_id, row, known, top, scores, unknown)

    @api.post("/v1/rank_full", response_model=RankResponse)
    async def rank_full(self, req: RankRequest) -> RankResponse:
        return await self._rank(req, self.full)

    @api.post("/v1/rank_teacher", response_model=RankResponse)
    async def rank_teacher(self, req: RankRequest) -> RankResponse:
        return await self._rank(req, self.teacher)


def build_baselines(
    manifest_uri: str,
    *,
    shards: int,
    app_name: str = "kvrank",
    full: bool = True,
    num_cpus: float = 0.5,
    teacher_uri: str | None = None,
    teacher_cpus: float = 1.0,
    teacher_gpus: float = 0.0,
):
    """The baselines app over the states of ``manifest_uri``, served by the production app
    ``app_name`` (deployed first, with ``shards`` store shards): the full-forward ranker
    (unless not ``full``) on ``num_cpus``, and with ``teacher_uri`` the vLLM teacher. The
    ingress reserves no CPU: it only waits on the others."""
    full = (
        FullForwardRanker.options(
            max_ongoing_requests=64, ray_actor_options={"num_cpus": num_cpus}
        ).bind(manifest_uri)
        if full
        else None
    )
    teacher = (
        TeacherRanker.options(
            max_ongoing_requests=64,
            ray_actor_options={"num_cpus": teacher_cpus, "num_gpus": teacher_gpus},
        ).bind(storage.read_marker(manifest_uri)["dataset_uri"], teacher_uri)
        if teacher_uri
        else None
    )
    return BaselinesIngress.options(ray_actor_options={"num_cpus": 0}).bind(
        manifest_uri, shards, app_name, full, teacher
    )
