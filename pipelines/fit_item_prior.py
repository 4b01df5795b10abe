"""Fit the item-to-item prior (``models.item_prior``) on a dataset's training histories, pick its
fit and how it reads a user's recent items on the validation split, and publish it.

    python -m pipelines.fit_item_prior --dataset-uri out/datasets/ml-latest-small --out out \\
        [--run NAME] [--kind next,ease] [--l2 200] [--neighbours 200] [--recent 10,20]
        [--decay 0.8,0.9] [--val-users 2000] [--vectors-uri DIR] [--text-neighbours 10]

The fit sees each user's history only (the training part of the split), never a validation or
test item, so the validation that picks ``--kind``, ``--l2``, ``--recent`` and ``--decay`` (each
one value or a comma list) is a clean one, and the test items stay unseen. A "next" fit is
solved once per (l2, recent, decay): its recency is part of the regression; an "ease" fit once
per l2, then read at every recency. Without ``--recent`` / ``--decay``, each kind tries its own
defaults (next: 10,20 x 0.8,0.9; ease: 1,3,5,10,20 x 0.5,0.7,0.85,1). Validation ranks each
sampled user's validation item over the full catalog minus their history, by the prior alone.
Each solve is dense N x N (N items: 9,742 for ml-latest-small, 16,859 for amazon, 1.1 GB in
float32) in this process: nothing in it splits across a cluster, so it runs in the driver
whether started directly or under ``ray job submit``.

Items no training history holds (new to the catalog, or held out by ``prepare_data
--holdout-items``) would score 0 under any fit; each one with a text vector borrows the rows and
columns of its ``--text-neighbours`` nearest interacted items (``models.item_prior``), so the
served score can rank a new item its text neighbours' voters would want. The vectors are the
default encoder's under ``--out`` unless ``--vectors-uri`` names others; without any, the job
says so and those items keep 0.

Writes ``<out>/item_priors/<dataset>/<run>/``: ``prior.parquet`` (vid, neighbours list<int32>,
weights list<float32>) and ``_SUCCESS.json`` (the picked config, the validation grid). The
summary line gives the pick and its validation NDCG@10 / HR@10.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from artifacts import storage
from artifacts.data import default_vectors_uri, item_table, user_sequences
from artifacts.prior import PRIOR_FILE, prior_table
from models.errors import InputError
from models.item_prior import (
    KINDS,
    ItemPrior,
    PriorConfig,
    borrow_from_text_neighbours,
    cooccurrence,
    ease_weights,
    interacted_items,
    next_item_grams,
    next_item_weights,
    sparsify,
)
from models.metrics import hit_at_k, ndcg_at_k, ranks_from_scores
from pipelines.common import cli, jobs

log = logging.getLogger("kvrank.fit_item_prior")

# the recencies each kind tries when none are given: a "next" fit solves once per pair, so it
# tries few; an "ease" fit is solved once and read at every pair
DEFAULT_RECENCY = {
    "next": ([10, 20], [0.8, 0.9]),
    "ease": ([1, 3, 5, 10, 20], [0.5, 0.7, 0.85, 1.0]),
}


def default_run(dataset: str) -> str:
    return f"{dataset}-prior"


def validate(
    prior: ItemPrior, hists: list[torch.Tensor], targets: torch.Tensor, batch: int = 256
) -> tuple[float, float]:
    """NDCG@10 and HR@10 of ``targets`` ranked by the prior over the catalog minus each
    user's history."""
    ranks = []
    for s in range(0, len(hists), batch):
        h = hists[s : s + batch]
        ranks.append(ranks_from_scores(prior.scores(h), targets[s : s + batch], h))
    r = torch.cat(ranks)
    return float(ndcg_at_k(r).mean()), float(hit_at_k(r).mean())


def fit_item_prior(
    dataset_uri: str,
    out: str,
    *,
    run: str | None = None,
    l2s: list[float],
    neighbours: int,
    kinds: list[str] | tuple[str, ...] = KINDS,
    recents: list[int] | None = None,
    decays: list[float] | None = None,
    val_users: int = 2000,
    vectors_uri: str | None = None,
    text_neighbours: int = 10,
    seed: int = 0,
) -> dict:
    t0 = time.perf_counter()
    dataset_uri = storage.pinned(dataset_uri)
    marker = storage.read_marker(dataset_uri)
    if not kinds or any(k not in KINDS for k in kinds):
        raise InputError(f"prior kinds must be some of {', '.join(KINDS)}; got {list(kinds)}")
    try:  # every combination is a valid config before any minute is spent fitting
        grid = [
            PriorConfig(l2, neighbours, r, d, kind)
            for kind in kinds
            for l2, r, d in itertools.product(
                l2s, recents or DEFAULT_RECENCY[kind][0], decays or DEFAULT_RECENCY[kind][1]
            )
        ]
    except ValueError as e:
        raise InputError(str(e)) from None
    n_items = int(marker["items"])
    target = storage.join(out, "item_priors", marker["name"], run or default_run(marker["name"]))
    storage.check_writable(target)
    seqs = user_sequences(dataset_uri)
    hists = [torch.as_tensor(np.asarray(h, dtype=np.int64)) for h in seqs["hist"].to_list()]
    pick = np.arange(len(hists))
    if val_users and val_users < len(hists):
        pick = np.sort(np.random.default_rng(seed).choice(len(hists), val_users, replace=False))
    val_h = [hists[i] for i in pick]
    val_t = torch.as_tensor(seqs["valid"].to_numpy()[pick])
    interacted = interacted_items(hists, n_items)
    unseen = int((~interacted).sum())
    vectors, borrowed = None, 0
    if text_neighbours and unseen and vectors_uri:
        vectors_uri = storage.pinned(vectors_uri)
        vectors = item_table(vectors_uri, n_items)[0]
        log.info(
            "%d items without a training interaction borrow from their %d nearest by text "
            "(those with a vector)",
            unseen,
            text_neighbours,
        )
    elif text_neighbours and unseen:
        log.warning(
            "no item vectors: the %d items without a training interaction keep prior 0 "
            "(run encode_items first, or pass --vectors-uri)",
            unseen,
        )

    def borrow(b: torch.Tensor) -> torch.Tensor:
        nonlocal borrowed
        if vectors is not None:
            b, borrowed = borrow_from_text_neighbours(b, interacted, vectors, text_neighbours)
        return b

    log.info(
        "fitting on %d users' histories (%d interactions), %d items; validating on %d users",
        len(hists),
        sum(len(h) for h in hists),
        n_items,
        len(val_h),
    )
    results, best = [], None
    for cfg, prior in fits(grid, hists, n_items, borrow):
        nd, hr = validate(prior, val_h, val_t)
        results.append(cfg.to_dict() | {"val_ndcg10": round(nd, 5), "val_hr10": round(hr, 4)})
        log.info(
            "%s, l2 %g, %d recent items, decay %g: validation NDCG@10 %.4f, HR@10 %.4f",
            *(cfg.kind, cfg.l2, cfg.recent, cfg.decay, nd, hr),
        )
        if best is None or nd > best[0]:
            best = (nd, hr, prior)
    assert best is not None
    nd, hr, prior = best
    pub = storage.Publication(target)
    try:
        pub.put_table(PRIOR_FILE, prior_table(prior))
        pub.publish(
            {
                "kind": "item_prior",
                "dataset": marker["name"],
                "dataset_uri": dataset_uri,
                "n_items": n_items,
                "config": prior.cfg.to_dict(),
                "val_users": len(val_h),
                "val_ndcg10": nd,
                "val_hr10": hr,
                "grid": results,
                "vectors_uri": vectors_uri if vectors is not None else None,
                "text_neighbours": text_neighbours if vectors is not None else 0,
                "borrowed_items": borrowed,
            }
        )
    except BaseException:
        pub.discard()
        raise
    return {
        "job": "fit_item_prior",
        "dataset": marker["name"],
        "items": n_items,
        "users": len(hists),
        **prior.cfg.to_dict(),
        "val_users": len(val_h),
        "val_ndcg10": round(nd, 4),
        "val_hr10": round(hr, 4),
        "configs_tried": len(results),
        "borrowed_items": borrowed,
        "out": target,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def fits(
    grid: list[PriorConfig],
    hists: list[torch.Tensor],
    n_items: int,
    borrow: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """Each config of ``grid`` fitted, as (config, ItemPrior), solving no more than it must:
    an "ease" solve per l2 (its recency is only how it is read), a "next" solve per config.
    ``borrow`` (dense weights -> dense weights) runs on each solve before it is made sparse."""
    borrow = borrow or (lambda b: b)
    ease = [c for c in grid if c.kind == "ease"]
    if ease:
        gram = cooccurrence(hists, n_items)
        for l2 in dict.fromkeys(c.l2 for c in ease):
            t1 = time.perf_counter()
            index, weight = sparsify(borrow(ease_weights(gram, l2)), ease[0].neighbours)
            log_solve("ease", l2, t1)
            for cfg in (c for c in ease if c.l2 == l2):
                yield cfg, ItemPrior(index, weight, cfg)
    nxt = [c for c in grid if c.kind == "next"]
    for recency in dict.fromkeys((c.recent, c.decay) for c in nxt):
        grams = next_item_grams(hists, n_items, *recency)
        for cfg in (c for c in nxt if (c.recent, c.decay) == recency):
            t1 = time.perf_counter()
            index, weight = sparsify(borrow(next_item_weights(*grams, cfg.l2)), cfg.neighbours)
            log_solve("next", cfg.l2, t1)
            yield cfg, ItemPrior(index, weight, cfg)


def log_solve(kind: str, l2: float, since: float) -> None:
    log.info("%s, l2 %g: solved in %.1f s", kind, l2, time.perf_counter() - since)


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of numbers, got {text!r}") from None


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of whole numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    d = PriorConfig()
    p = cli.job_parser("fit_item_prior", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset to fit on")
    p.add_argument("--out", required=True, help="output root (local path or s3://)")
    p.add_argument("--run", default=None, help="default: <dataset>-prior")
    p.add_argument(
        "--kind",
        type=lambda text: [x for x in text.split(",") if x],  # fit_item_prior checks the names
        default=list(KINDS),
        help=f"fit(s), comma list of {', '.join(KINDS)}",
    )
    p.add_argument("--l2", type=floats, default=[d.l2], help="ridge weight(s), comma list")
    p.add_argument("--neighbours", type=int, default=d.neighbours, help="weights kept an item")
    p.add_argument("--recent", type=ints, default=None, help="newest items voting (per kind)")
    p.add_argument("--decay", type=floats, default=None, help="vote decay (default: per kind)")
    p.add_argument("--val-users", type=int, default=2000, help="0: every user")
    p.add_argument(
        "--vectors-uri",
        default=None,
        help="item_vectors folder the items without interactions borrow through "
        "(default: the default encoder's under --out, when published)",
    )
    p.add_argument(
        "--text-neighbours",
        type=int,
        default=10,
        help="interacted items, nearest by text, that an item without interactions borrows "
        "its weights from; 0: it keeps prior 0",
    )
    a = cli.parse(p, argv)
    if a.text_neighbours < 0:
        p.error(f"--text-neighbours must be 0 or more, got {a.text_neighbours}")

    def job() -> dict:
        vectors = a.vectors_uri
        if vectors is None and a.text_neighbours > 0:
            name = storage.read_marker(a.dataset_uri)["name"]
            default = default_vectors_uri(a.out, name)
            vectors = default if storage.exists(storage.join(default, storage.MARKER)) else None
        return fit_item_prior(
            a.dataset_uri,
            a.out,
            run=a.run,
            l2s=a.l2,
            neighbours=a.neighbours,
            kinds=a.kind,
            recents=a.recent,
            decays=a.decay,
            val_users=a.val_users,
            vectors_uri=vectors,
            text_neighbours=a.text_neighbours,
        )

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
