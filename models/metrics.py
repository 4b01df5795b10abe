"""Ranking metrics and the two evaluation protocols (full catalog, sampled negatives), in plain
PyTorch on top of ``Ranker.prefill`` / ``score_tokens``. Ranks are 0-based: rank r means r
other items scored at least as high as the target. Ties count against the target, so a model
that scores everything alike (collapsed, or untrained) ranks last, not first."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from models.ranker import Cache, History, Ranker


def ndcg_at_k(ranks: Tensor, k: int = 10) -> Tensor:
    """Per-user NDCG@k with one relevant item: 1 / log2(rank + 2) if rank < k else 0."""
    r = ranks.to(torch.float64)
    return torch.where(r < k, 1.0 / torch.log2(r + 2.0), torch.zeros_like(r))


def hit_at_k(ranks: Tensor, k: int = 10) -> Tensor:
    return (ranks < k).to(torch.float64)


def summarize(ranks) -> dict[str, float]:
    """Mean NDCG@10 and HR@10 of 0-based ranks (a tensor or a numpy array)."""
    r = (
        ranks if isinstance(ranks, Tensor) else torch.tensor(ranks)
    )  # a copy: arrays may be read-only
    return {"ndcg10": float(ndcg_at_k(r).mean()), "hr10": float(hit_at_k(r).mean())}


def ndcg_se(ranks, paired=None) -> float:
    """The standard error of a mean NDCG@10 over users; with ``paired`` (another model's ranks
    of the same users, in the same order), of the mean per-user difference ranks - paired."""
    nd = ndcg_at_k(torch.as_tensor(ranks))
    if paired is not None:
        nd = nd - ndcg_at_k(torch.as_tensor(paired))
    return float(nd.std() / math.sqrt(len(nd))) if len(nd) > 1 else float("nan")


@torch.no_grad()
def full_catalog_ranks(
    model: Ranker,
    history: History | Cache,
    targets: Tensor,
    exclude: list[Tensor],
    n_items: int,
    chunk: int = 256,
) -> Tensor:
    """Rank of each user's target among all ``n_items`` items minus ``exclude[b]`` (vids the
    user already has). targets (B,) vids -> ranks (B,) long.

    One prefill per user (or the stored cache, as serving uses it: pass a cache instead of the
    history); the catalog is scored in chunks by MIS, its candidate tokens computed once per
    chunk for the whole batch.
    """
    scores = full_catalog_scores(model, history, n_items, chunk)
    return ranks_from_scores(scores, targets, exclude)


@torch.no_grad()
def full_catalog_scores(
    model: Ranker, history: History | Cache, n_items: int, chunk: int = 256
) -> Tensor:
    """The served score of every catalog item for each user: (B, n_items), by MIS in chunks of
    ``chunk`` candidates (what ``full_catalog_ranks`` ranks)."""
    cache = _cache(model, history)
    dev = cache.lengths.device
    scores = torch.empty(len(cache.lengths), n_items, device=dev)
    for start in range(0, n_items, chunk):
        vids = torch.arange(start, min(start + chunk, n_items), device=dev)
        scores[:, start : start + len(vids)] = model.score_tokens(
            cache, model.candidate_tokens(vids)
        )
    return scores


@torch.no_grad()
def dot_catalog_ranks(
    model: Ranker,
    history: History | Cache,
    targets: Tensor,
    exclude: list[Tensor],
    tokens: Tensor | None = None,
) -> Tensor:
    """As ``full_catalog_ranks``, by the user token's part of the score alone: <u, item token>
    for every item, one matrix product instead of a MIS pass over the catalog (a ranker with a
    user token only). The cheap proxy training validates every user with; the MIS head's part
    is left out, so these ranks are not the served ones. ``tokens``: ``model.catalog_tokens()``
    when the caller ranks many batches with one model (computed here otherwise)."""
    return ranks_from_scores(dot_catalog_scores(model, history, tokens), targets, exclude)


@torch.no_grad()
def dot_catalog_scores(
    model: Ranker, history: History | Cache, tokens: Tensor | None = None
) -> Tensor:
    """What ``dot_catalog_ranks`` ranks: <u, item token> for every item, (B, n_items)."""
    tokens = model.catalog_tokens() if tokens is None else tokens
    return model.user_vector(_cache(model, history)) @ tokens.T


def ranks_from_scores(scores: Tensor, targets: Tensor, exclude: list[Tensor]) -> Tensor:
    """scores (B, n_items) -> each target's rank among the items not in ``exclude[b]``."""
    target_scores = scores.gather(1, targets[:, None])
    for b, ex in enumerate(exclude):
        if len(ex):
            scores[b, ex.to(scores.device)] = -math.inf
    scores.scatter_(1, targets[:, None], target_scores)  # the target itself is never excluded
    return (scores >= target_scores).sum(1) - 1  # minus the target itself


@torch.no_grad()
def sampled_ranks(
    model: Ranker, history: History | Cache, targets: Tensor, negatives: Tensor
) -> Tensor:
    """Rank of each target among itself and its sampled negatives (B, K) -> ranks (B,); ties
    count against the target."""
    cands = torch.cat([targets[:, None], negatives], dim=1)
    scores = model.score(_cache(model, history), cands)
    return (scores[:, 1:] >= scores[:, :1]).sum(1)


def _cache(model: Ranker, history: History | Cache) -> Cache:
    """A history is prefilled here; a cache (e.g. a stored compressed state) is used as is."""
    return model.prefill(history) if isinstance(history, History) else model.expand(history)
