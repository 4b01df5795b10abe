"""Fit the item-to-item prior (``models.item_prior``) on a dataset's training histories, pick how
it reads a user's recent items on the validation split, and publish it.

    python -m pipelines.fit_item_prior --dataset-uri out/datasets/ml-latest-small --out out \\
        [--run NAME] [--l2 200] [--neighbours 200] [--recent 1,3,5,10,20]
        [--decay 0.5,0.7,0.85,1] [--val-users 2000]

The fit sees each user's history only (the training part of the split), never a validation or
test item, so the validation that picks ``--l2`` (one value or a comma list: a solve each),
``--recent`` and ``--decay`` is a clean one, and the test items stay unseen. Validation ranks
each sampled user's validation item over the full catalog minus their history, by the prior
alone. The fit is one dense N x N solve (N items: 9,742 for ml-latest-small, 16,859 for amazon,
1.1 GB in float32) in this process: nothing in it splits across a cluster, so it runs in the
driver whether started directly or under ``ray job submit``.

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

import numpy as np
import pyarrow as pa
import torch

from models.item_prior import ItemPrior, PriorConfig, cooccurrence, ease_weights, sparsify
from models.metrics import hit_at_k, ndcg_at_k, ranks_from_scores
from pipelines import jobs, storage
from pipelines.data import user_sequences
from pipelines.sources import InputError

log = logging.getLogger("kvrank.fit_item_prior")

PRIOR_FILE = "prior.parquet"


def default_run(dataset: str) -> str:
    return f"{dataset}-ease"


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
    recents: list[int],
    decays: list[float],
    val_users: int = 2000,
    seed: int = 0,
) -> dict:
    t0 = time.perf_counter()
    dataset_uri = storage.absolute(dataset_uri)
    marker = storage.read_marker(dataset_uri)
    try:  # every combination is a valid config before any minute is spent fitting
        grid = [
            PriorConfig(l2, neighbours, r, d)
            for l2, r, d in itertools.product(l2s, recents, decays)
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
    log.info(
        "fitting on %d users' histories (%d interactions), %d items; validating on %d users",
        len(hists),
        sum(len(h) for h in hists),
        n_items,
        len(val_h),
    )
    gram = cooccurrence(hists, n_items)
    results, best = [], None
    for l2 in l2s:
        t1 = time.perf_counter()
        index, weight = sparsify(ease_weights(gram, l2), neighbours)
        seconds = time.perf_counter() - t1
        log.info("l2 %g: solved, %d neighbours an item kept, in %.1f s", l2, neighbours, seconds)
        base = ItemPrior(index, weight, PriorConfig(l2, neighbours))
        for cfg in (c for c in grid if c.l2 == l2):
            prior = base.with_recency(cfg.recent, cfg.decay)
            nd, hr = validate(prior, val_h, val_t)
            results.append(cfg.to_dict() | {"val_ndcg10": round(nd, 5), "val_hr10": round(hr, 4)})
            log.info(
                "l2 %g, %d recent items, decay %g: validation NDCG@10 %.4f, HR@10 %.4f",
                *(l2, cfg.recent, cfg.decay, nd, hr),
            )
            if best is None or nd > best[0]:
                best = (nd, hr, prior)
    assert best is not None
    nd, hr, prior = best
    table = pa.table(
        {
            "vid": pa.array(np.arange(n_items, dtype=np.int32)),
            "neighbours": pa.array(list(prior.index.numpy()), type=pa.list_(pa.int32())),
            "weights": pa.array(list(prior.weight.numpy()), type=pa.list_(pa.float32())),
        }
    )
    pub = storage.Publication(target)
    try:
        pub.put_table(PRIOR_FILE, table)
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
        "out": target,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def read_prior(uri: str, n_items: int | None = None) -> tuple[ItemPrior, dict]:
    """A published prior and its marker; ``n_items`` (the ranker's catalog) must match."""
    uri = storage.absolute(uri)
    marker = storage.read_marker(uri)
    if marker.get("kind") != "item_prior":
        raise InputError(f"{uri} is not an item prior (fit_item_prior publishes one)")
    if n_items is not None and int(marker["n_items"]) != n_items:
        raise InputError(f"{uri} was fitted on {marker['n_items']} items, not {n_items}")
    t = storage.read_parquet(storage.join(uri, PRIOR_FILE))
    index = torch.as_tensor(np.stack(t["neighbours"].to_numpy(zero_copy_only=False)))
    weight = torch.as_tensor(np.stack(t["weights"].to_numpy(zero_copy_only=False)))
    return ItemPrior(index, weight, PriorConfig(**marker["config"])), marker


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
    p = argparse.ArgumentParser(
        prog="python -m pipelines.fit_item_prior", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--out", required=True, help="output root (local path or s3://)")
    p.add_argument("--run", default=None, help="default: <dataset>-ease")
    p.add_argument("--l2", type=floats, default=[d.l2], help="ridge weight(s), comma list")
    p.add_argument("--neighbours", type=int, default=d.neighbours, help="weights kept an item")
    p.add_argument("--recent", type=ints, default=[1, 3, 5, 10, 20], help="newest items voting")
    p.add_argument("--decay", type=floats, default=[0.5, 0.7, 0.85, 1.0], help="vote decay")
    p.add_argument("--val-users", type=int, default=2000, help="0: every user")
    a = p.parse_args(argv)
    return jobs.run(
        lambda: fit_item_prior(
            a.dataset_uri,
            a.out,
            run=a.run,
            l2s=a.l2,
            neighbours=a.neighbours,
            recents=a.recent,
            decays=a.decay,
            val_users=a.val_users,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
