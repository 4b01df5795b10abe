"""The item prior inside training (``train_ranker --item-prior``): the out-of-fold priors each
user's windows read, the weight the prior starts at, and the prior's offsets added to the
ranker's candidate and catalog logits - the fused score serving ranks by."""

from __future__ import annotations

import dataclasses
import io
import logging
import time

import numpy as np
import torch

from artifacts import storage
from models.errors import InputError
from pipelines.common.training import open_file

log = logging.getLogger("kvrank.train_ranker")


def prior_offsets(priors, tb, vids, next_vids, cands, cut) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior's score of each candidate, read after the history its cut shows (B, C(1+K)),
    and of every catalog item after each position that has a next item (R, N) - the rows of
    the user token's catalog logits, in their order."""
    rows = next_vids >= 0
    folds = None if tb.folds is None else tb.folds.to(vids.device)
    catalog = priors.prefix_scores(vids, rows, folds)
    row_of = rows.flatten().cumsum(0).view(rows.shape) - 1  # (b, p) -> its row
    return catalog[row_of.gather(1, cut - 1), cands], catalog


PRIOR_NEGATIVE_POOL = 100  # a cut's mined negatives come from the prior's top this many


def prior_negatives(
    priors, vids, next_vids, cands, cut, negatives: int, m: int, held=None
) -> torch.Tensor:
    """``cands`` (B, C(1+K)) with the first ``m`` negatives of each cut replaced by items the
    prior ranks in its top ``PRIOR_NEGATIVE_POOL`` after the history that cut shows - the
    competitors the served score's prior puts forward, so the ranker learns to order them.
    Never an item of the window (its history or next items: its positives) nor a ``held``
    (held-out) one; a cut whose prior votes for nothing keeps its uniform negatives."""
    from models.item_prior import sample_top

    b, k = len(cands), 1 + negatives
    first = cut.view(b, -1, k)[:, :, 0]  # (B, C): the history length each cut shows
    rows = torch.zeros_like(vids, dtype=torch.bool).scatter_(1, first - 1, True)
    scores = priors.prefix_scores(vids, rows)  # (R, N), one row per distinct cut
    row_of = rows.flatten().cumsum(0).view(rows.shape) - 1
    owner = rows.nonzero(as_tuple=True)[0]
    window = torch.cat([vids, next_vids], 1)[owner]  # (R, W), padding (< 0) to column N
    n = scores.shape[1]
    exclude = torch.zeros(len(scores), n + 1, dtype=torch.bool, device=scores.device)
    exclude = exclude.scatter_(1, torch.where(window >= 0, window, n), True)[:, :n]
    if held is not None:
        exclude[:, held] = True
    mined = sample_top(scores, exclude, m, PRIOR_NEGATIVE_POOL)[row_of.gather(1, first - 1)]
    out = cands.view(b, -1, k).clone()
    out[:, :, 1 : 1 + m] = torch.where(mined >= 0, mined, out[:, :, 1 : 1 + m])
    return out.view(b, -1)


def load_negatives_prior(uri: str, n_items: int):
    """The published prior at ``uri`` as the ``StackedPriors`` (of one) ``prior_negatives``
    mines from."""
    from artifacts.prior import read_prior
    from models.item_prior import StackedPriors

    return StackedPriors.of([read_prior(uri, n_items)[0]])


def fused(model, out, offsets, catalog: bool):
    """``out`` (a ``RankerOutput``) with the prior's offsets added at the model's prior
    weight (unchanged without offsets, or for a model trained without the prior)."""
    weight = getattr(model, "module", model).prior_weight
    if offsets is None or weight is None:
        return out
    cand, cat = offsets
    return dataclasses.replace(
        out,
        scores=out.scores + weight * cand,
        catalog=out.catalog + weight * cat if catalog else out.catalog,
    )


PRIOR_FOLDS = 5  # out-of-fold priors: each fitted on 80% of the users


def prior_folds(user_ids: np.ndarray, seed: int) -> np.ndarray:
    """Each user's fold 0..PRIOR_FOLDS-1, seeded: as even as the users allow."""
    order = np.random.default_rng([seed, 0xF01D]).permutation(len(user_ids))
    folds = np.empty(len(user_ids), dtype=np.int64)
    folds[order] = np.arange(len(user_ids)) % PRIOR_FOLDS
    return folds


def fold_priors(
    item_prior: str, dataset_uri: str, users, folds: np.ndarray, n_items: int, target: str
) -> float:
    """Refit the published prior's config once per fold, without that fold's users, and write
    them to ``target`` stacked with the published prior (fitted on everyone: the one
    validation, evaluation and serving read) last - what training's offsets come from.
    Returns the calibrated starting weight, out of fold (``calibrated_weight``)."""
    from artifacts.data import item_table
    from artifacts.prior import read_prior
    from models.item_prior import ItemPrior, StackedPriors

    full, marker = read_prior(item_prior, n_items)
    if marker.get("dataset_uri") != dataset_uri:
        raise InputError(
            f"{item_prior} was fitted on {marker.get('dataset_uri')}, not on {dataset_uri}"
        )
    hists = [torch.as_tensor(np.asarray(h, dtype=np.int64)) for h in users["hist"].to_list()]
    # as the published prior did, an item no history of the rest holds borrows from its text
    # neighbours: the offsets training reads are what serving reads for such an item
    k = int(marker.get("text_neighbours") or 0)
    vectors = item_table(marker["vectors_uri"], n_items)[0] if k else None
    fitted = []
    for f in range(PRIOR_FOLDS):
        t0 = time.perf_counter()
        rest = [h for h, g in zip(hists, folds, strict=True) if g != f]
        fitted.append(ItemPrior.fit(rest, n_items, full.cfg, vectors, k))
        log.info(
            "item prior without fold %d/%d (%d users) refitted in %.1f s",
            f + 1,
            PRIOR_FOLDS,
            len(rest),
            time.perf_counter() - t0,
        )
    # each user's last history item after the rest, by the prior fitted without them
    pick = np.random.default_rng(0).permutation(len(hists))[:CALIBRATION_USERS]
    scores = torch.zeros(len(pick), n_items)
    for row, i in enumerate(pick):
        scores[row] = fitted[int(folds[i])].scores([hists[i][:-1]])[0]
    targets = torch.as_tensor([int(hists[i][-1]) for i in pick], dtype=torch.long)
    weight = calibrated_weight(scores, targets)
    log.info(
        "the prior's weight starts at %.1f (calibrated on %d users, out of fold)", weight, len(pick)
    )
    stacked = StackedPriors.of([*fitted, full])
    buf = io.BytesIO()
    torch.save({"index": stacked.index, "weight": stacked.weight, "cfg": full.cfg.to_dict()}, buf)
    storage.write_bytes(target, buf.getvalue())
    return weight


CALIBRATION_USERS = 2000


def calibrated_weight(scores: torch.Tensor, targets: torch.Tensor) -> float:
    """The w at which softmax(w x prior) over the catalog best predicts ``targets``: the mean
    log-likelihood is concave in w, so a golden-section search over log w in [0.1, 10^5]
    finds it. Training starts the prior's weight there - the prior alone as the best model it
    can be - and the ranker learns the rest. scores (U, N), targets (U,)."""
    if len(targets) == 0:
        return 1.0

    def loglik(log_w: float) -> float:
        logits = scores * float(np.exp(log_w))
        return float(torch.log_softmax(logits, 1).gather(1, targets[:, None]).mean())

    lo, hi = np.log(0.1), np.log(1e5)
    ratio = (np.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loglik(a) < loglik(b):
            lo = a
        else:
            hi = b
    return float(np.exp((lo + hi) / 2))


def load_priors(uri: str):
    """The ``StackedPriors`` ``fold_priors`` wrote."""
    from models.item_prior import PriorConfig, StackedPriors

    d = torch.load(open_file(*uri.rsplit("/", 1)), map_location="cpu", weights_only=True)
    return StackedPriors(d["index"], d["weight"], PriorConfig(**d["cfg"]))
