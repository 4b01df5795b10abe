"""What a ranker replica computes, without Ray: rank candidates from stored states, extend them.

A user's state travels as one row of ``artifacts.states`` (a dict: user_id, hist, hist_fb,
length and per-layer index / user-part buffers): a few bytes per history item and layer, so
any replica can take any user's state, expand it on its device and score - replicas keep
nothing per user and scale freely.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import Tensor

from artifacts import retrieval, states, storage
from models.batches import history_batch
from models.inputs import CompressedCache, Event, History

Row = dict  # one user's state row (artifacts.states format)
log = logging.getLogger("kvrank.engine")


class RankEngine:
    """The ranker of one manifest, and optionally the item-to-item prior: with
    ``item_prior_uri`` (a ``fit_item_prior`` output) every candidate's score is the ranker's plus
    ``item_prior_weight`` x its prior from the user's newest history items - the fused score
    ``evaluate --item-prior`` measures, whose metrics.json gives the weight it picked."""

    def __init__(
        self,
        manifest_uri: str,
        device: str = "cpu",
        item_prior_uri: str | None = None,
        item_prior_weight: float = 0.0,
        slack_items: int = 50,
        follow_vectors: bool = False,
    ) -> None:
        from artifacts.data import load_ranker

        self.manifest = storage.read_marker(manifest_uri)
        if self.manifest.get("kind") != "user_states":
            raise ValueError(f"{manifest_uri} is not a user_states folder")
        self.device = torch.device(device)
        # the item vectors the states were built with; following, the newest version of their
        # folder (re-encoded texts score at once; the states keep what they were built from)
        self.vectors_uri = self.manifest.get("vectors_uri")
        if follow_vectors and self.vectors_uri:
            self.vectors_uri = storage.resolve(storage.root_of(self.vectors_uri))
        self.model, ranker_marker, self.max_len = load_ranker(
            self.manifest["checkpoint"], self.vectors_uri
        )
        self.n_items = int(ranker_marker["n_items"])
        self._catalog = None  # every item's candidate token, for recommend (per item table)
        self.index = None  # the retrieval index built with the states, for large catalogs
        index_meta = self.manifest.get("retrieval_index")
        if index_meta and self.vectors_uri == self.manifest.get("vectors_uri"):
            blob = storage.read_file(manifest_uri, index_meta["file"], marker=self.manifest)
            self.index = retrieval.load(blob, index_meta)
        self.follow = bool(follow_vectors and self.vectors_uri and self.model.cfg.reads_vectors)
        self.model.to(self.device).eval()
        self.slack_items = slack_items
        self.prior, self.prior_weight = None, item_prior_weight
        if item_prior_uri:
            from artifacts.prior import read_prior

            self.prior, _ = read_prior(item_prior_uri, int(ranker_marker["n_items"]))
        cfg = self.model.cfg
        self.layout = states.Layout.of(cfg)
        self.last_timings = {"expand_s": 0.0, "score_s": 0.0}
        self._empty = self._prefill_rows([-1], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)])[0]

    def follow_vectors(self) -> str | None:
        """With ``follow_vectors``: swap in the item table of a version of the item vectors
        published since the last call (``encode_items`` re-encoding changed texts). Returns the
        version now served when it changed, else None. A version that does not fit this ranker
        raises and leaves the table being served as it was."""
        from artifacts.data import item_table

        if not self.follow:
            return None
        newest = storage.resolve(storage.root_of(self.vectors_uri))
        if newest == self.vectors_uri:
            return None
        table, _ = item_table(newest, self.n_items)
        # one reference swap: a forward running meanwhile reads the old table or the new one
        self.model.set_item_table(table)
        self._catalog = None
        if self.index is not None:  # built from the old tokens: exact until states are rebuilt
            log.warning(
                "item vectors %s: recommend retrieves exactly over the catalog until states "
                "(and their retrieval index) are built with them",
                newest,
            )
            self.index = None
        self.vectors_uri = newest
        return newest

    # -- state rows <-> caches

    def _prefill_rows(self, user_ids, hist, fb) -> list[Row]:
        h = history_batch(hist, fb, self.max_len)
        h = History(h.vids.to(self.device), h.feedback.to(self.device), h.lengths.to(self.device))
        cache = self.model.prefill(h)
        return states.to_table(_cpu(cache), user_ids, hist, fb, self.layout).to_pylist()

    def _cache(self, rows: list[Row]) -> CompressedCache:
        table = {k: [r[k] for r in rows] for k in rows[0]}
        return states.from_table(table, self.layout, device=self.device)

    def empty_state(self, user_id: int) -> Row:
        """The state of a user with no history: BOS only."""
        return dict(self._empty, user_id=int(user_id))

    # -- serving

    @torch.no_grad()
    def rank(self, rows: list[Row], candidates: list[list[int]], ks: list[int]):
        """Per request: (vids, scores) of its top k candidates, best first. One expand and one
        MIS forward for the whole batch of requests."""
        t0 = time.perf_counter()
        cache = self.model.expand(self._cache(rows))
        t1 = time.perf_counter()
        width = max(len(c) for c in candidates)
        cand = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, c in enumerate(candidates):
            cand[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
        scores = self.model.score(cache, cand.to(self.device)).float().cpu()
        if self.prior is not None:
            prior = self.prior.scores([torch.as_tensor(r["hist"], dtype=torch.long) for r in rows])
            scores += self.prior_weight * prior.gather(1, cand.clamp(min=0))  # -1: padding
        self.last_timings = {"expand_s": t1 - t0, "score_s": time.perf_counter() - t1}
        out = []
        for i, (c, k) in enumerate(zip(candidates, ks, strict=True)):
            top = torch.topk(scores[i, : len(c)], min(k, len(c)))
            out.append((cand[i, top.indices].tolist(), top.values.tolist()))
        return out

    @torch.no_grad()
    def recommend(self, rows: list[Row], ks: list[int], retrieve: int, exclude_seen: list[bool]):
        """Per user: (vids, scores) of the best k items of the whole catalog, best first, in two
        stages. Retrieval (``retrieved``): the ``retrieve`` items with the largest dot product
        of the user vector with their candidate token, plus the weighted prior when there is
        one - the served score without the per-candidate head. Then those are ranked with the
        full score (``rank``). With ``exclude_seen`` the user's history items are left out.
        Without a retrieval index, ``retrieve`` >= the catalog makes it exact."""
        hists = [torch.as_tensor(r["hist"], dtype=torch.long) for r in rows]
        candidates = self.retrieved(self._cache(rows), hists, retrieve, exclude_seen)
        keep = [i for i, c in enumerate(candidates) if c]  # a user who has seen everything
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        if keep:
            ranked = self.rank(
                [rows[i] for i in keep], [candidates[i] for i in keep], [ks[i] for i in keep]
            )
            for i, r in zip(keep, ranked, strict=True):
                out[i] = r
        return out

    def retrieved(self, cache, hists: list[Tensor], retrieve: int, exclude_seen: list[bool]):
        """The first stage of ``recommend``: per user, the ids of up to ``retrieve`` items, best
        first. Exact (one matrix product over the catalog for the batch) unless the states
        came with a retrieval index (``artifacts.retrieval``, large catalogs): then the index's
        best items by the dot product, joined by every item the prior scores (the neighbours
        of the user's newest items), are scored exactly and the best kept."""
        if self._catalog is None:
            self._catalog = self.model.catalog_tokens().float()
        users = self.model.user_vector(cache).float()
        prior = self.prior.scores(hists) if self.prior is not None else None
        if self.index is None:  # one matrix product and one top-k for the batch
            approx = users @ self._catalog.T  # (B, n_items)
            if prior is not None:
                approx += self.prior_weight * prior.to(approx.device)
            for i, h in enumerate(hists):
                if exclude_seen[i] and len(h):
                    approx[i, h.to(approx.device)] = float("-inf")
            top = approx.topk(min(retrieve, self.n_items), dim=1)
            return [
                idx[torch.isfinite(val)].tolist()
                for idx, val in zip(top.indices.cpu(), top.values.cpu(), strict=True)
            ]
        wanted = min(retrieve + max(len(h) for h in hists), self.n_items)
        found = retrieval.search(self.index, users.cpu().numpy(), wanted)
        out = []
        for i, h in enumerate(hists):
            pool = torch.as_tensor(found[i], dtype=torch.long)
            if prior is not None:
                pool = torch.unique(torch.cat([pool, prior[i].nonzero().flatten()]))
            scores = users[i] @ self._catalog[pool.to(self.device)].T
            if prior is not None:
                scores += self.prior_weight * prior[i, pool].to(scores.device)
            if exclude_seen[i] and len(h):
                scores[torch.isin(pool, h).nonzero().flatten().to(scores.device)] = float("-inf")
            top = scores.topk(min(retrieve, len(scores)))
            out.append(pool[top.indices.cpu()[torch.isfinite(top.values.cpu())]].tolist())
        return out

    @torch.no_grad()
    def extend(self, row: Row, vid: int, feedback: int) -> Row:
        """The state after one more event: a decode step against the expanded state. Past
        ``max_len + slack_items`` history items it is rebuilt by prefill from the newest
        ``max_len`` (the windows the ranker was trained on), so no state grows without end."""
        hist = np.append(np.asarray(row["hist"], dtype=np.int64), vid)
        fb = np.append(np.asarray(row["hist_fb"], dtype=np.int64), feedback)
        if len(hist) > self.max_len + self.slack_items:
            keep = slice(len(hist) - self.max_len, None)
            return self._prefill_rows([row["user_id"]], [hist[keep]], [fb[keep]])[0]
        cache = self.model.extend(
            self._cache([row]),
            Event(
                torch.tensor([vid], device=self.device),
                torch.tensor([feedback], device=self.device),
            ),
        )
        table = states.to_table(_cpu(cache), [row["user_id"]], [hist], [fb], self.layout)
        return table.to_pylist()[0]


def _cpu(cache: CompressedCache) -> CompressedCache:
    return CompressedCache([s.map(lambda t: t.cpu()) for s in cache.layers], cache.lengths.cpu())
