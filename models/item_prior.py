"""An item-to-item prior: which items go with the ones a user just had, fitted in closed form
from the training histories, and read at ranking time as a recency-weighted sum of the rows of
the user's last few items. Two fits share that reading (``PriorConfig.kind``):

- ``"next"`` (the default): the ridge regression of the next item on the items before it, each
  weighted by how recent it is - a linear next-item model (the transition part of SLIST: Choi
  et al., "Session-aware Linear Item-Item Models for Session-based Recommendation", 2021).
  Over the context matrix S (one row per training position t: ``decay^(k-1)`` at item
  h_{t-k}, k = 1..recent) and the next-item matrix Y (one-hot h_t), B = (S^T S + l2 I)^-1 S^T Y.
  It knows order: what comes after a user's last items, not only what sits beside them.
- ``"ease"``: the ridge regression of each item on all the others a user has (EASE: Steck,
  "Embarrassingly Shallow Autoencoders for Sparse Data", 2019): over the user-item matrix X,
  B = I - P diag(1 / diag(P)), P = (X^T X + l2 I)^-1. Order-free co-occurrence.

Why beside the ranker: the ranker sees the catalog through one user vector and per-item tokens
of width d_model, learnt from the users' sequences; with few users (ml-latest-small has 610)
what goes with what across 9,742 items is learnt slowly through that bottleneck. The item-item
matrix is full rank and comes from one linear solve over the same training histories. Kept
sparse (each item's ``neighbours`` largest weights), reading it is one gather and one
scatter-add per recent history item: a user's prior for item j is
``sum_k decay^k B[h_{T-k}, j]`` over the last ``recent`` history items h (newest k = 0), the
same weights the "next" fit gave its context.

    prior = ItemPrior.fit(histories, n_items, PriorConfig(l2=200.0, neighbours=200))
    scores = prior.scores([torch.tensor([3, 17, 5])])   # (1, n_items)

An item no training history holds (new to the catalog) has an empty row and column under
either fit: nothing votes for it, so fused with the ranker it ranks below every item the
user's recent items vote for, however well the ranker scores its text. Given the items' text
vectors, ``borrow_from_text_neighbours`` gives such an item the softmax-weighted mix of the
rows and columns of its nearest interacted items by cosine: it receives and casts votes as
its text neighbours do.

Plain PyTorch; the pipeline job (``pipelines.fit_item_prior``) fits, tunes and stores it.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

KINDS = ("next", "ease")


@dataclass(frozen=True)
class PriorConfig:
    l2: float = 200.0  # ridge weight of the fit; larger shrinks rare items' rows toward zero
    neighbours: int = 200  # weights kept per item (its largest); the rest are dropped
    recent: int = 10  # how many of the newest history items vote (and, for "next", are fitted)
    decay: float = 0.85  # weight of the k-th newest vote: decay^k
    kind: str = "next"  # which fit: one of KINDS (see the module's docstring)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.l2 <= 0:
            raise ValueError(f"l2 must be positive, got {self.l2}")
        if self.neighbours < 1 or self.recent < 1:
            raise ValueError(
                f"neighbours and recent must be at least 1, got {self.neighbours}, {self.recent}"
            )
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def to_dict(self) -> dict:
        return asdict(self)


def cooccurrence(histories: list[Tensor], n_items: int) -> Tensor:
    """G = X^T X (n_items, n_items) float32 for the binary user-item matrix X of
    ``histories`` (one 1-D vid tensor per user; repeats count once)."""
    rows, cols = [], []
    for u, h in enumerate(histories):
        items = torch.unique(h.long())
        rows.append(torch.full_like(items, u))
        cols.append(items)
    if not rows:
        return torch.zeros(n_items, n_items)
    idx = torch.stack([torch.cat(rows), torch.cat(cols)])
    x = torch.sparse_coo_tensor(
        idx, torch.ones(idx.shape[1]), (len(histories), n_items), check_invariants=True
    ).coalesce()
    with warnings.catch_warnings():  # sparse @ sparse goes through CSR, which torch calls beta
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse.mm(x.t().coalesce(), x).to_dense()


def ease_weights(gram: Tensor, l2: float) -> Tensor:
    """The EASE item-item matrix from G = X^T X (N, N): B = -P / diag(P) by column, diagonal
    zero, P = (G + l2 I)^-1 (by Cholesky: G + l2 I is symmetric positive definite)."""
    p = torch.cholesky_inverse(ridge_cholesky(gram, l2))
    b = p / (-p.diagonal())[None, :]
    b.diagonal().zero_()
    return b.float()


def next_item_grams(
    histories: list[Tensor], n_items: int, recent: int, decay: float
) -> tuple[Tensor, Tensor]:
    """S^T S and S^T Y (both (n_items, n_items) float32) of the "next" fit: one row of S per
    position t >= 1 of each history, ``decay^(k-1)`` at item h_{t-k} for k = 1..recent (an item
    twice in the window adds up); Y one-hot at h_t."""
    lens = torch.as_tensor([len(h) for h in histories], dtype=torch.long)
    flat = torch.cat([h.long() for h in histories]) if len(histories) else torch.zeros(0).long()
    start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    pos = torch.arange(len(flat)) - start  # each interaction's position in its history
    rows_of = torch.cumsum(pos >= 1, 0) - 1  # a training row per position t >= 1
    n_rows = int((pos >= 1).sum())
    rows, cols, vals = [], [], []
    for k in range(1, recent + 1):
        t = torch.nonzero(pos >= k).flatten()
        rows.append(rows_of[t])
        cols.append(flat[t - k])
        vals.append(torch.full((len(t),), decay ** (k - 1)))
    targets = torch.nonzero(pos >= 1).flatten()
    s = torch.sparse_coo_tensor(
        torch.stack([torch.cat(rows), torch.cat(cols)]),
        torch.cat(vals),
        (n_rows, n_items),
        check_invariants=True,
    ).coalesce()
    y = torch.sparse_coo_tensor(
        torch.stack([rows_of[targets], flat[targets]]),
        torch.ones(n_rows),
        (n_rows, n_items),
        check_invariants=True,
    ).coalesce()
    st = s.t().coalesce()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse.mm(st, s).to_dense(), torch.sparse.mm(st, y).to_dense()


def next_item_weights(gram: Tensor, cross: Tensor, l2: float) -> Tensor:
    """The "next" fit's item-item matrix (N, N): B = (S^T S + l2 I)^-1 S^T Y from
    ``next_item_grams`` (by Cholesky: S^T S + l2 I is symmetric positive definite)."""
    return torch.cholesky_solve(cross.float(), ridge_cholesky(gram, l2))


def ridge_cholesky(gram: Tensor, l2: float) -> Tensor:
    """The lower Cholesky factor of gram + l2 I, in float32 (both fits' one factorisation)."""
    a = gram.float().clone()
    a.diagonal().add_(l2)
    return torch.linalg.cholesky(a)


def sparsify(b: Tensor, neighbours: int) -> tuple[Tensor, Tensor]:
    """Each row's ``neighbours`` largest weights: (N, K) int32 column indices and float32
    weights, K = min(neighbours, N). Negative weights among them are kept as they are."""
    k = min(neighbours, b.shape[1])
    w, idx = torch.topk(b, k, dim=1)
    return idx.to(torch.int32), w.float()


# how sharply an unseen item's borrowed weights favour its nearest text neighbour: a softmax
# over cosine similarities at this temperature. On amazon-videogames-2018 with 10% of the items
# held out (the prior alone, ease, its 10 nearest): 0.05 gave the held-out items' users NDCG@10
# 0.006 and left every other figure within 1.5%; 1.0 (near-uniform) 0.0019; copying the single
# nearest item 0.0124 but cost 10% on validation (near-duplicate editions crowd the top 10)
NEIGHBOUR_TEMPERATURE = 0.05


def interacted_items(histories: list[Tensor], n_items: int) -> Tensor:
    """(n_items,) bool: which items some history holds."""
    seen = torch.zeros(n_items, dtype=torch.bool)
    for h in histories:
        seen[h.long()] = True
    return seen


def borrow_from_text_neighbours(
    b: Tensor, interacted: Tensor, vectors: Tensor, k: int, chunk: int = 256
) -> tuple[Tensor, int]:
    """``b`` (N, N) dense item-item weights with each item that no training history holds
    (``interacted`` (N,) bool false) and that has a vector (``vectors`` (N, dim), zero rows:
    none) given the weighted mix of its ``k`` nearest interacted items' rows and columns. In
    place; returns (b, how many items borrowed). The diagonal stays zero."""
    unit = torch.nn.functional.normalize(vectors.float(), dim=1)
    has_vector = vectors.abs().sum(dim=1) > 0
    seen = (interacted & has_vector).nonzero().squeeze(1)
    new = (~interacted & has_vector).nonzero().squeeze(1)
    if k < 1 or not len(new) or not len(seen):
        return b, 0
    k = min(k, len(seen))
    sims, idx = (unit[new] @ unit[seen].T).topk(k, dim=1)
    w = torch.softmax(sims / NEIGHBOUR_TEMPERATURE, dim=1).to(b.dtype)  # (U, k)
    donors = seen[idx]  # (U, k)
    parts = [
        (new[a : a + chunk], donors[a : a + chunk], w[a : a + chunk])
        for a in range(0, len(new), chunk)
    ]
    for u, d, wu in parts:  # the votes it receives
        b[:, u] = torch.einsum("nuk,uk->nu", b[:, d], wu)
    for u, d, wu in parts:  # the votes it casts
        b[u, :] = torch.einsum("ukn,uk->un", b[d, :], wu)
    b.fill_diagonal_(0.0)
    return b, len(new)


class ItemPrior:
    """The sparse item-item weights and how a user's recent items read them. ``index`` (N, K)
    int32 and ``weight`` (N, K) float32: row i says how much item i votes for each of its K
    neighbours."""

    def __init__(self, index: Tensor, weight: Tensor, cfg: PriorConfig) -> None:
        if index.shape != weight.shape or index.dim() != 2:
            raise ValueError(f"index {tuple(index.shape)} and weight {tuple(weight.shape)} differ")
        self.index, self.weight, self.cfg = index, weight, cfg

    @property
    def n_items(self) -> int:
        return self.index.shape[0]

    @classmethod
    def fit(
        cls,
        histories: list[Tensor],
        n_items: int,
        cfg: PriorConfig,
        vectors: Tensor | None = None,
        text_neighbours: int = 0,
    ) -> ItemPrior:
        """Fit ``cfg`` on ``histories``; given item ``vectors``, each item no history holds
        borrows from its ``text_neighbours`` nearest interacted items."""
        if cfg.kind == "ease":
            b = ease_weights(cooccurrence(histories, n_items), cfg.l2)
        else:
            grams = next_item_grams(histories, n_items, cfg.recent, cfg.decay)
            b = next_item_weights(*grams, cfg.l2)
        if vectors is not None and text_neighbours:
            seen = interacted_items(histories, n_items)
            b = borrow_from_text_neighbours(b, seen, vectors, text_neighbours)[0]
        return cls(*sparsify(b, cfg.neighbours), cfg)

    def with_recency(self, recent: int, decay: float) -> ItemPrior:
        """The same weights read with another recency (what tuning an "ease" fit on validation
        varies; a "next" fit is read as it was fitted)."""
        return ItemPrior(self.index, self.weight, replace(self.cfg, recent=recent, decay=decay))

    def scores(self, histories: list[Tensor]) -> Tensor:
        """Prior of every item for each user: histories (B users, 1-D vid tensors, oldest
        first) -> (B, n_items) float32. An empty history scores every item 0."""
        out = torch.zeros(len(histories), self.n_items)
        for b, h in enumerate(histories):
            last = h[-self.cfg.recent :].long().flip(0)  # newest first
            if not len(last):
                continue
            votes = self.cfg.decay ** torch.arange(len(last), dtype=torch.float32)
            w = self.weight[last] * votes[:, None]  # (L, K)
            out[b].index_add_(0, self.index[last].reshape(-1).long(), w.reshape(-1))
        return out


def prefix_scores(
    index: Tensor,
    weight: Tensor,
    cfg: PriorConfig,
    vids: Tensor,
    rows: Tensor,
    folds: Tensor | None = None,
) -> Tensor:
    """The prior's score of every item after each wanted history prefix, as
    ``ItemPrior.scores`` reads a history, for a whole batch at once: vids (B, T) right-padded
    with -1, rows (B, T) bool (the prefix ending at position p, for each true (b, p)) ->
    (R, N) in row-major order of the R true positions. index/weight (F, N, K) stack F priors of
    one config; ``folds`` (B,) says which one each history reads (None: the first)."""
    b, p = rows.nonzero(as_tuple=True)
    k = torch.arange(cfg.recent, device=vids.device)
    pos = p[:, None] - k[None, :]  # (R, recent): newest first
    items = vids[b[:, None], pos.clamp(min=0)]
    live = (pos >= 0) & (items >= 0)
    items = items.clamp(min=0)
    f = (folds[b] if folds is not None else torch.zeros_like(b))[:, None]
    votes = cfg.decay ** k.to(weight.dtype) * live  # (R, recent)
    w = weight[f, items] * votes[..., None]  # (R, recent, K)
    out = torch.zeros(len(b), index.shape[1], dtype=weight.dtype, device=weight.device)
    return out.scatter_add_(1, index[f, items].reshape(len(b), -1).long(), w.reshape(len(b), -1))


@dataclass(frozen=True)
class StackedPriors:
    """F priors of one config stacked for ``prefix_scores``: what training reads its offsets
    from, each user's windows scored by a prior fitted without that user (their fold's)."""

    index: Tensor  # (F, N, K) int32
    weight: Tensor  # (F, N, K) float32
    cfg: PriorConfig

    @classmethod
    def of(cls, priors: list[ItemPrior]) -> StackedPriors:
        return cls(
            torch.stack([p.index for p in priors]),
            torch.stack([p.weight for p in priors]),
            priors[0].cfg,
        )

    def to(self, device) -> StackedPriors:
        return StackedPriors(self.index.to(device), self.weight.to(device), self.cfg)

    def prior(self, f: int) -> ItemPrior:
        return ItemPrior(self.index[f].cpu(), self.weight[f].cpu(), self.cfg)

    def prefix_scores(self, vids: Tensor, rows: Tensor, folds: Tensor | None = None) -> Tensor:
        return prefix_scores(self.index, self.weight, self.cfg, vids, rows, folds)


def sample_top(scores: Tensor, exclude: Tensor, m: int, top: int) -> Tensor:
    """``m`` items per row drawn uniformly (with replacement) from the ``top`` items the row
    scores highest, among those it scores above 0 and does not ``exclude``: scores (R, N),
    exclude (R, N) bool -> (R, m) vids, -1 in a row with no such item. Mining a prior's
    candidates as a ranker's negatives: the items a user's recent items vote for."""
    val, idx = scores.masked_fill(exclude, float("-inf")).topk(min(top, scores.shape[1]), dim=1)
    live = (val > 0).sum(1, keepdim=True)  # topk sorts: the live items come first
    pos = (torch.rand(len(scores), m, device=scores.device) * live).long()
    picked = idx.gather(1, pos.clamp(max=idx.shape[1] - 1))
    return torch.where(live > 0, picked, torch.full_like(picked, -1))


# the prior's weights tried against the ranker's score on validation: the fused score is
# ranker + weight * prior, raw, so that any subset of the catalog (a request's candidates)
# ranks as it would in the whole catalog; the grid is log-spaced (x2-2.5 a step) because the
# two scores' scales differ by model and dataset
FUSION_WEIGHTS = (0.0,) + tuple(
    round(m * 10.0**e, 4) for e in range(-2, 4) for m in (1.0, 2.0, 5.0)
)


def fuse(ranker: Tensor, prior: Tensor, weight: float) -> Tensor:
    """The fused score of every item: ranker + weight * prior, both (B, N) or (B, C)."""
    return ranker + weight * prior
