"""Validation of a ranker during training: full-catalog NDCG@10 and HR@10 of held-out users'
validation items, each Ray Train worker scoring its share of the users."""

from __future__ import annotations

import numpy as np
import torch

from artifacts.data import user_sequences
from pipelines.common.training import all_sum


def worker_sums(
    model,
    val: dict,
    n_items: int,
    max_len: int,
    rank: int,
    world: int,
    score: str = "served",
    prior=None,
) -> tuple[float, float, int]:
    """(sum of NDCG@10, sum of HR@10, users) over this worker's part of the validation users,
    ranked over the full catalog by the served score or, with ``score="dot"``, the user token's
    dot product alone; a ranker trained complementary to the item ``prior`` (an ``ItemPrior``)
    adds its ``prior_weight`` x the prior's score, as it is served."""
    from models.batches import history_batch
    from models.metrics import (
        dot_catalog_scores,
        full_catalog_scores,
        hit_at_k,
        ndcg_at_k,
        ranks_from_scores,
    )

    idx = list(range(rank, len(val["valid"]), world))
    if not idx:
        return 0.0, 0.0, 0
    nd, hr = 0.0, 0.0
    m = (model.module if hasattr(model, "module") else model).eval()  # DDP-wrapped or not
    dev = next(m.parameters()).device
    with torch.no_grad():  # the catalog's tokens, once for every batch (the dot score only)
        tokens = m.catalog_tokens() if score == "dot" else None
    for start in range(0, len(idx), 32):
        part = idx[start : start + 32]
        hist = history_batch(
            [val["hist"][i] for i in part], [val["hist_fb"][i] for i in part], max_len
        )
        hist = type(hist)(hist.vids.to(dev), hist.feedback.to(dev), hist.lengths.to(dev))
        targets = torch.tensor([val["valid"][i] for i in part], device=dev)
        exclude = [torch.as_tensor(val["hist"][i]) for i in part]
        with torch.no_grad():
            if score == "dot":
                scores = dot_catalog_scores(m, hist, tokens)
            else:
                scores = full_catalog_scores(m, hist, n_items)
            if prior is not None and m.prior_weight is not None:
                offset = prior.scores([torch.as_tensor(val["hist"][i]) for i in part])
                scores = scores + m.prior_weight * offset.to(dev)
        ranks = ranks_from_scores(scores, targets, exclude)
        nd += float(ndcg_at_k(ranks).sum())
        hr += float(hit_at_k(ranks).sum())
    return nd, hr, len(idx)


def sample_val(dataset_uri: str, n: int, seed: int, columns: tuple[str, ...]) -> dict:
    """``columns`` of ``n`` seeded random users with a history (their split's sequences), as
    lists: the validation users of a training job, the same users for one seed."""
    seqs = user_sequences(dataset_uri)
    seqs = seqs.filter(seqs["hist"].list.len() >= 1)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(seqs.height, size=min(n, seqs.height), replace=False))
    sub = seqs[pick]
    return {c: sub[c].to_list() for c in columns}


def load_val(dataset_uri: str, n: int, seed: int) -> dict:
    """The ranker's validation users: histories (arrays), feedback and validation items."""
    val = sample_val(dataset_uri, n, seed, ("hist", "hist_fb", "valid"))
    return val | {k: [np.asarray(x) for x in val[k]] for k in ("hist", "hist_fb")}


def validate(
    model,
    val: dict,
    n_items: int,
    max_len: int,
    rank: int,
    world: int,
    score: str = "served",
    prior=None,
) -> tuple[float, float, int]:
    """(NDCG@10, HR@10, users) over all workers' validation users (every worker calls it)."""
    sums = worker_sums(model, val, n_items, max_len, rank, world, score, prior)
    nd, hr, n = all_sum(list(sums), world)
    return nd / max(n, 1), hr / max(n, 1), int(n)
