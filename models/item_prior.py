"""An item-to-item prior: which items go with the ones a user just had, fitted in closed form
from who had what (EASE: Steck, "Embarrassingly Shallow Autoencoders for Sparse Data", 2019),
and read at ranking time as a recency-weighted sum of the rows of the user's last few items.

Why beside the ranker: the ranker sees the catalog through one user vector and per-item tokens
of width d_model, learnt from the users' sequences; with few users (ml-latest-small has 610)
what goes with what across 9,742 items is learnt slowly through that bottleneck. EASE's
item-item matrix is full rank and comes from one linear solve over the same training histories.
Kept sparse (each item's ``neighbours`` largest weights), reading it is one gather and one
scatter-add per recent history item.

The fit (B: (N, N), zero diagonal) minimises ||X - X B||^2 + l2 ||B||^2 over the user-item
matrix X; its solution is B = I - P diag(1 / diag(P)) with P = (X^T X + l2 I)^-1. A user's
prior for item j is ``sum_k decay^k B[h_{T-k}, j]`` over the last ``recent`` history items
h (newest k = 0).

    prior = ItemPrior.fit(histories, n_items, PriorConfig(l2=200.0, neighbours=200))
    scores = prior.scores([torch.tensor([3, 17, 5])])   # (1, n_items)

Plain PyTorch; the pipeline job (``pipelines.fit_item_prior``) fits, tunes and stores it.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PriorConfig:
    l2: float = 200.0  # ridge weight of the fit; larger shrinks rare items' rows toward zero
    neighbours: int = 200  # weights kept per item (its largest); the rest are dropped
    recent: int = 10  # how many of the newest history items vote
    decay: float = 0.85  # weight of the k-th newest vote: decay^k

    def __post_init__(self) -> None:
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
    a = gram.float().clone()
    a.diagonal().add_(l2)
    p = torch.cholesky_inverse(torch.linalg.cholesky(a))
    b = p / (-p.diagonal())[None, :]
    b.diagonal().zero_()
    return b.float()


def sparsify(b: Tensor, neighbours: int) -> tuple[Tensor, Tensor]:
    """Each row's ``neighbours`` largest weights: (N, K) int32 column indices and float32
    weights, K = min(neighbours, N). Negative weights among them are kept as they are."""
    k = min(neighbours, b.shape[1])
    w, idx = torch.topk(b, k, dim=1)
    return idx.to(torch.int32), w.float()


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
    def fit(cls, histories: list[Tensor], n_items: int, cfg: PriorConfig) -> ItemPrior:
        b = ease_weights(cooccurrence(histories, n_items), cfg.l2)
        return cls(*sparsify(b, cfg.neighbours), cfg)

    def with_recency(self, recent: int, decay: float) -> ItemPrior:
        """The same weights read with another recency (what tuning on validation varies)."""
        cfg = PriorConfig(self.cfg.l2, self.cfg.neighbours, recent, decay)
        return ItemPrior(self.index, self.weight, cfg)

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
