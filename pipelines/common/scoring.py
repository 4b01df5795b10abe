"""Scoring users for evaluation, as Ray Data actors: ``ScoreUsers`` ranks each user's test item
under one checkpoint (from a prefill of the history, or from the stored states as serving
does); ``PriorFusionRanks`` adds the item-to-item prior (``models.item_prior``), for
``pipelines.evaluate --item-prior``: ranker score + weight x prior, the weight picked from
``FUSION_WEIGHTS`` on the validation split (history -> validation item) of the same users,
then the test item ranked (history + validation item -> test item) as evaluate ranks the
ranker. The sum needs no
statistic of the whole catalog, so a request's candidates would rank by it as they do here.

The Serve application serves the same sum (``services.engine.RankEngine`` with
``item_prior_uri`` and the weight picked here).
"""

from __future__ import annotations

import logging

import numpy as np
import polars as pl
import pyarrow as pa

from models.errors import InputError
from models.metrics import summarize
from pipelines.common.ranker_actors import RankerActor, map_with_rankers

log = logging.getLogger("kvrank.evaluate")


class ScoreUsers(RankerActor):
    """Ray Data callable class: ranks of each user's test item under one checkpoint."""

    def __init__(
        self, checkpoint: str, vectors_uri: str | None, threads: int, from_states: bool = False
    ) -> None:
        super().__init__(checkpoint, vectors_uri, threads)
        self.n_items = int(self.marker["n_items"])
        self.from_states = from_states

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from models.batches import history_batch
        from models.metrics import full_catalog_ranks, sampled_ranks

        hist = [np.array(h, dtype=np.int64) for h in batch["input"]]  # writable copies for torch
        hist_fb = [np.asarray(f) for f in batch["input_fb"]]
        h = history_batch(hist, hist_fb, self.max_len)
        if self.from_states:  # score from the stored compressed states, as serving does
            h = self._stored_cache(batch, hist)
        targets = torch.as_tensor(batch["test"].astype(np.int64))
        full = full_catalog_ranks(
            self.model, h, targets, [torch.as_tensor(x) for x in hist], self.n_items
        )
        negs = torch.as_tensor(np.stack(batch["negatives"]).astype(np.int64))
        sampled = sampled_ranks(self.model, h, targets, negs)
        return {
            "user_id": batch["user_id"],
            "full_rank": full.numpy(),
            "sampled_rank": sampled.numpy(),
        }

    def _stored_cache(self, batch: dict[str, np.ndarray], inputs: list[np.ndarray]):
        from artifacts import states

        for uid, stored, inp in zip(batch["user_id"], batch["hist"], inputs, strict=True):
            if not np.array_equal(np.asarray(stored), inp[-self.max_len :]):
                raise InputError(
                    f"user {uid}: the stored state's history is not this user's test input "
                    "(history + validation item); were the states built from another dataset?"
                )
        return states.from_table(batch, states.Layout.of(self.model.cfg))


class PriorFusionRanks(ScoreUsers):
    """Ray Data callable class: the item prior alone, and the ranker's score fused with it at
    each of ``FUSION_WEIGHTS``, on the test input (history + validation item -> test item)
    and on the validation input (history -> validation item), which picks the weight.

    With ``from_states`` the test input is scored from the user's stored state, as serving
    scores it; the validation input (one item shorter than any stored state) is prefilled.

    ``weights``: the fusion weights to rank by (default ``FUSION_WEIGHTS``).

    Returns per user ``prior_full_rank`` / ``prior_sampled_rank`` and, for the i-th weight,
    ``fused_val_rank_i``, ``fused_full_rank_i`` and ``fused_sampled_rank_i``."""

    def __init__(
        self,
        checkpoint: str,
        vectors_uri: str | None,
        threads: int,
        from_states: bool,
        prior: str,
        weights: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__(checkpoint, vectors_uri, threads, from_states)
        from artifacts.prior import read_prior
        from models.item_prior import FUSION_WEIGHTS

        self.prior, _ = read_prior(prior, self.n_items)
        self.weights = FUSION_WEIGHTS if weights is None else weights

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from models.item_prior import fuse
        from models.metrics import ranks_from_scores

        inputs = [np.array(h, dtype=np.int64) for h in batch["input"]]
        fbs = [np.asarray(f) for f in batch["input_fb"]]
        val_t = torch.as_tensor([x[-1] for x in inputs])
        test_t = torch.as_tensor(batch["test"].astype(np.int64))
        negs = torch.as_tensor(np.stack(batch["negatives"]).astype(np.int64))
        cands = torch.cat([test_t[:, None], negs], dim=1)
        val_r, val_p = self._scores([x[:-1] for x in inputs], [f[:-1] for f in fbs])
        stored = self._stored_cache(batch, inputs) if self.from_states else None
        test_r, test_p = self._scores(inputs, fbs, stored)
        seen_val = [torch.as_tensor(x[:-1]) for x in inputs]
        seen = [torch.as_tensor(x) for x in inputs]
        out = {"user_id": batch["user_id"]}
        out["prior_full_rank"] = ranks_from_scores(test_p.clone(), test_t, seen).numpy()
        out["prior_sampled_rank"] = sampled_from_scores(test_p, cands)
        cols: dict[str, list] = {
            "fused_val_rank": [],
            "fused_full_rank": [],
            "fused_sampled_rank": [],
        }
        for w in self.weights:
            cols["fused_val_rank"].append(ranks_from_scores(fuse(val_r, val_p, w), val_t, seen_val))
            fused = fuse(test_r, test_p, w)
            cols["fused_sampled_rank"].append(torch.as_tensor(sampled_from_scores(fused, cands)))
            cols["fused_full_rank"].append(ranks_from_scores(fused, test_t, seen))
        # one column per weight: Ray Data and polars pass plain 1-D columns through unchanged
        return out | {
            f"{k}_{i}": torch.as_tensor(r).numpy()
            for k, ranks in cols.items()
            for i, r in enumerate(ranks)
        }

    def _scores(self, inputs: list[np.ndarray], fbs: list[np.ndarray], stored=None):
        """The ranker's catalog scores (from ``stored``, a cache, when given; else a prefill
        of ``inputs``) and the prior's, both (B, n_items)."""
        import torch

        from models.batches import history_batch
        from models.metrics import full_catalog_scores

        h = history_batch(inputs, fbs, self.max_len) if stored is None else stored
        ranker = full_catalog_scores(self.model, h, self.n_items)
        return ranker, self.prior.scores([torch.as_tensor(x) for x in inputs])


def sampled_from_scores(scores, cands) -> np.ndarray:
    """Rank of column 0 of ``cands`` (B, 1 + K) among the row's candidates, by ``scores``
    (B, N); ties count against it."""
    s = scores.gather(1, cands)
    return (s[:, 1:] >= s[:, :1]).sum(1).numpy()


def prior_fusion(
    per_user: pl.DataFrame,
    table: pa.Table,
    checkpoint: str,
    vectors_uri: str | None,
    prior: str,
    actors: int,
    from_states: bool = False,
    trained_weight: float | None = None,
) -> tuple[pl.DataFrame, dict]:
    """The ranker, the prior alone and the two fused (``PriorFusionRanks``), the fusion weight
    picked by validation NDCG@10 over per_user's ``in_sample`` users: per_user gains
    ``ranker_*`` (the fusion at weight 0: the ranker needs no pass of its own),
    ``item_prior_*`` and ``ranker_prior_*`` rank columns; returns it with the pick and the
    validation curve. A ranker trained complementary to the prior (``trained_weight``: its
    learned weight) is fused at that weight, not at one picked after training."""
    import ray

    from models.item_prior import FUSION_WEIGHTS

    log.info("scoring %d users with the ranker fused with the item prior %s", table.num_rows, prior)
    res = map_with_rankers(
        table,
        PriorFusionRanks,
        checkpoint,
        vectors_uri,
        actors=actors,
        batch_size=16,
        extra_args=(from_states, prior, None if trained_weight is None else (0.0, trained_weight)),
    )
    weights = FUSION_WEIGHTS if trained_weight is None else (0.0, trained_weight)
    got = pl.from_arrow(pa.concat_tables(ray.get(res.to_arrow_refs())))
    # picked on the seeded sample alone (evaluate adds new-item users beside it)
    picks = got.join(per_user.filter("in_sample").select("user_id"), on="user_id", how="semi")
    val = [summarize(picks[f"fused_val_rank_{i}"].to_numpy()) for i in range(len(weights))]
    best = (
        1
        if trained_weight is not None
        else max(range(len(weights)), key=lambda i: val[i]["ndcg10"])
    )
    log.info(
        "fusion weight %g %s (validation NDCG@10 %.4f; at weight 0, the ranker: %.4f)",
        weights[best],
        "learned in training" if trained_weight is not None else "picked on validation",
        val[best]["ndcg10"],
        val[0]["ndcg10"],
    )
    alone = weights.index(0.0)  # weight 0: the ranker's own score, ranked the same way
    ranks = got.select(
        "user_id",
        pl.col(f"fused_full_rank_{alone}").alias("ranker_full_rank"),
        pl.col(f"fused_sampled_rank_{alone}").alias("ranker_sampled_rank"),
        pl.col("prior_full_rank").alias("item_prior_full_rank"),
        pl.col("prior_sampled_rank").alias("item_prior_sampled_rank"),
        pl.col(f"fused_full_rank_{best}").alias("ranker_prior_full_rank"),
        pl.col(f"fused_sampled_rank_{best}").alias("ranker_prior_sampled_rank"),
    )
    fusion = {
        "prior": prior,
        "weight": weights[best],
        "learned": trained_weight is not None,
        "val_ndcg10_by_weight": {
            str(w): round(v["ndcg10"], 5) for w, v in zip(weights, val, strict=True)
        },
    }
    return per_user.join(ranks, on="user_id", how="left"), fusion
