"""CollectiveKV: the keys and values of cached history tokens, mostly shared across users.

Per attention layer there is a K pool and a V pool of ``M`` learnable entries of width
``kv_width - d_u``. For each cached token with hidden state x (the layer's normed input):

    idx_k = argmax(router_k x)                 (a linear router, top-1)
    k     = concat(pool_k[idx_k], SiLU(W_uk x)) (W_uk: d_model -> d_u, tiny and user-specific)

and the same for V with its own router, pool and projection. Rotary positions are applied after
this reconstruction, so the stored state is position-free. A user's state per layer is
``idx_k, idx_v`` (uint16 while M <= 65,536) and ``u_k, u_v`` (fp16, [T, d_u]); ``expand`` turns
it back into K and V with one gather and one concat on the device that holds the pools.

Training signal for the routers: the paper scales the chosen entry by sigmoid(router logit). A
stored state holds only the index, so serving could not reproduce that scale; we use its
straight-through form - the forward value is exactly the pool entry (scale 1), the backward pass
carries the gradient of the sigmoid gate to the router - so training computes exactly what
serving will. The user part is likewise rounded to fp16 in the forward pass (straight-through),
so expanding the stored state gives the on-the-fly K and V bit for bit. Aux losses, as in the
paper: peak = -mean log softmax(logits)[top1], balance = KL(mean softmax || uniform).

Sharing can be switched off for K or for V (``CollectiveKVConfig.share_k`` / ``share_v``, the
ablation of which half the pools carry): that side is then the layer's plain projection, stored
whole in fp16 (``idx_*`` None, ``u_*`` kv_width wide).

This module knows nothing about attention or positions; ``models.ranker`` wires it in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import CollectiveKVConfig

STATE_DTYPE = torch.float16  # storage dtype of the user parts


@dataclass
class LayerState:
    """One layer's compressed KV for a batch: idx_* (B, L) uint16/int32, u_* (B, L, width) fp16.

    ``idx_k`` is None when K is not shared (then ``u_k`` holds the whole key, kv_width wide);
    the same for V."""

    idx_k: Tensor | None
    idx_v: Tensor | None
    u_k: Tensor
    u_v: Tensor

    def nbytes(self, lengths: Tensor) -> int:
        """Stored bytes for the valid tokens (``lengths`` (B,)), padding excluded."""
        per_token = sum(
            t.element_size() * (t.shape[-1] if t.dim() == 3 else 1)
            for t in (self.idx_k, self.idx_v, self.u_k, self.u_v)
            if t is not None
        )
        return int(lengths.sum()) * per_token

    def map(self, fn) -> LayerState:
        return LayerState(*(None if t is None else fn(t) for t in self.parts()))

    def parts(self) -> tuple[Tensor | None, ...]:
        return self.idx_k, self.idx_v, self.u_k, self.u_v


@dataclass
class Routing:
    """What a forward pass through one layer's CollectiveKV produces besides K and V."""

    state: LayerState
    aux_loss: Tensor  # weighted peak + balance losses (scalar)
    peak_loss: Tensor
    balance_loss: Tensor


def peak_loss(logits: Tensor, valid: Tensor) -> Tensor:
    """-mean over valid tokens of log softmax(logits)[top1]. logits (B, L, M), valid (B, L)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    top = logp.max(dim=-1).values
    return -(top * valid).sum() / valid.sum().clamp(min=1)


def balance_loss(logits: Tensor, valid: Tensor) -> Tensor:
    """KL(mean softmax over valid tokens || uniform over the M entries)."""
    p = torch.softmax(logits.float(), dim=-1) * valid.unsqueeze(-1)
    mean = p.sum(dim=(0, 1)) / valid.sum().clamp(min=1)
    m = logits.shape[-1]
    return (mean * (torch.log(mean.clamp(min=1e-12)) + math.log(m))).sum()


def round_to_state(u: Tensor) -> Tensor:
    """The value the state will hold, with the gradient of the unrounded value."""
    return u + (u.to(STATE_DTYPE).to(u.dtype) - u).detach()


class CollectiveKV(nn.Module):
    """One layer's routers, pools and user projections for K and V (those that are shared).

    A side with sharing off has no parameters here (``router_k``, ``pool_k``, ``user_k`` are
    None for K): its cached value is the layer's own projection (``k_proj``, passed to
    ``forward``), stored whole in fp16."""

    def __init__(self, d_model: int, kv_width: int, cfg: CollectiveKVConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shared = kv_width - cfg.user_dim
        for side, on in (("k", cfg.share_k), ("v", cfg.share_v)):
            router = nn.Linear(d_model, cfg.pool_size) if on else None
            pool = nn.Parameter(torch.randn(cfg.pool_size, shared) * 0.02) if on else None
            user = nn.Linear(d_model, cfg.user_dim, bias=False) if on else None
            setattr(self, f"router_{side}", router)
            setattr(self, f"pool_{side}", pool)
            setattr(self, f"user_{side}", user)
        self.index_dtype = torch.uint16 if cfg.pool_size <= 65536 else torch.int32

    def side(self, kv: str) -> tuple[nn.Linear, nn.Parameter, nn.Linear] | None:
        """(router, pool, user projection) of K (``kv`` 'k') or V, None when it is not shared."""
        router = getattr(self, f"router_{kv}")
        return (
            None
            if router is None
            else (router, getattr(self, f"pool_{kv}"), getattr(self, f"user_{kv}"))
        )

    def forward(
        self, x: Tensor, valid: Tensor, k_proj: nn.Module, v_proj: nn.Module
    ) -> tuple[Tensor, Tensor, Routing]:
        """K and V for cached tokens, computed on the fly, plus their compressed state.

        x (B, L, d_model), valid (B, L) bool -> k, v (B, L, kv_width) without rotary, Routing.
        ``k_proj`` / ``v_proj`` give the side whose sharing is off.
        """
        vf = valid.to(x.dtype)
        peak = bal = x.new_zeros(())
        out = []
        for kv, proj in (("k", k_proj), ("v", v_proj)):
            side = self.side(kv)
            if side is None:  # sharing off: the plain projection, stored as it is
                u = round_to_state(proj(x))
                out.append((u, None, u))
                continue
            router, pool, user = side
            logits = router(x)
            idx = logits.argmax(-1)
            u = round_to_state(F.silu(user(x)))
            out.append((torch.cat([pool[idx] * _st_gate(logits, idx), u], dim=-1), idx, u))
            peak = peak + peak_loss(logits, vf)
            bal = bal + balance_loss(logits, vf)
        (k, idx_k, u_k), (v, idx_v, u_v) = out
        aux = self.cfg.peak_weight * peak + self.cfg.balance_weight * bal
        state = LayerState(
            None if idx_k is None else idx_k.to(self.index_dtype),
            None if idx_v is None else idx_v.to(self.index_dtype),
            u_k.detach().to(STATE_DTYPE),
            u_v.detach().to(STATE_DTYPE),
        )
        return k, v, Routing(state, aux, peak.detach(), bal.detach())

    def expand(self, state: LayerState, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """state -> k, v (B, L, kv_width) in ``dtype``, without rotary: a gather and a concat."""
        return (
            _expand(self.pool_k, state.idx_k, state.u_k, dtype),
            _expand(self.pool_v, state.idx_v, state.u_v, dtype),
        )


def _expand(pool: Tensor | None, idx: Tensor | None, u: Tensor, dtype: torch.dtype) -> Tensor:
    if pool is None:  # not shared: the state holds the whole vector
        return u.to(dtype)
    return torch.cat([pool[idx.long()].to(dtype), u.to(dtype)], dim=-1)


def _st_gate(logits: Tensor, idx: Tensor) -> Tensor:
    """Straight-through sigmoid gate: value exactly 1, gradient d sigmoid(logit[idx])."""
    s = torch.sigmoid(logits.gather(-1, idx.unsqueeze(-1)))
    return 1.0 + (s - s.detach())  # parenthesised: (1 + s) - s is not exactly 1 in floats


def full_kv_bytes(tokens: int, n_layers: int, kv_width: int) -> int:
    """Bytes of the plain fp16 KV cache for ``tokens`` cached tokens: T * layers * 2 * width * 2."""
    return tokens * n_layers * 2 * kv_width * 2


def state_bytes_per_token(cfg: CollectiveKVConfig, n_layers: int, kv_width: int) -> int:
    """Closed form of the stored bytes per cached token: per layer and shared side one index
    and d_u fp16 numbers; an unshared side kv_width fp16 numbers."""
    shared = cfg.index_bytes + cfg.user_dim * 2
    return n_layers * sum(shared if on else kv_width * 2 for on in (cfg.share_k, cfg.share_v))


def compression_ratio(cfg: CollectiveKVConfig, n_layers: int, kv_width: int) -> float:
    """stored state bytes / full fp16 KV bytes; (4 + 4 d_u) / (4 kv_width) with uint16 indices
    and both K and V shared."""
    return state_bytes_per_token(cfg, n_layers, kv_width) / full_kv_bytes(1, n_layers, kv_width)


# ----------------------------------------------------------------------------- fitting the pools


@torch.no_grad()
def kmeans(
    x: Tensor, m: int, iters: int = 10, seed: int = 0, chunk: int = 8192
) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means of rows x (N, D) -> centroids (m, D), assignment (N,).

    Starts from m random rows (with replacement plus a little noise when N < m); an entry that
    loses all its rows is re-seeded at a random row. Distances are computed in chunks of rows
    so memory stays at ``chunk * m`` floats."""
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    x = x.float()
    pick = torch.randperm(n, generator=g)[:m] if n >= m else torch.randint(n, (m,), generator=g)
    c = x[pick].clone()
    if n < m:
        c += 1e-3 * x.std() * torch.randn(c.shape, generator=g)
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        assign = nearest(x, c, chunk)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=m)
        empty = counts == 0
        c = torch.where(empty[:, None], c, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            c[empty] = x[torch.randint(n, (int(empty.sum()),), generator=g)]
    return c, nearest(x, c, chunk)


def nearest(x: Tensor, c: Tensor, chunk: int = 8192) -> Tensor:
    """Index of the nearest centroid (euclidean) for each row of x."""
    c2 = (c * c).sum(1)
    return torch.cat(
        [(c2 - 2 * x[i : i + chunk] @ c.T).argmin(1) for i in range(0, x.shape[0], chunk)]
    )


@torch.no_grad()
def init_from_projections(
    ckv: CollectiveKV,
    x: Tensor,
    k_proj: nn.Linear,
    v_proj: nn.Linear,
    iters: int = 10,
    seed: int = 0,
) -> dict[str, float]:
    """Initialise one layer's pools, routers and user projections from a trained layer's
    ``k_proj`` / ``v_proj`` and sample hidden states x (N, d_model) of cached tokens.

    The shared part of K (its first kv_width - d_u dims) is vector-quantised: k-means over the
    sampled keys gives the pool, so top-1 selection starts at the least-squares codebook. The
    router starts as the nearest-centroid classifier written on x: argmin ||W x - c_j||^2 =
    argmax 2 c_j.W x - ||c_j||^2, weight 2 W^T c_j and bias -||c_j||^2. The user
    projection starts as the last d_u rows of the trained projection. The same for V. Returns
    the relative squared error of the shared part under the k-means assignment and under the
    router's, for K and V (the sides that are shared)."""
    stats = {}
    for name, proj in (("k", k_proj), ("v", v_proj)):
        side = ckv.side(name)
        if side is None:
            continue
        router, pool, user = side
        shared = pool.shape[1]
        kv = proj(x.to(proj.weight.dtype))[:, :shared].float()
        c, assign = kmeans(kv, pool.shape[0], iters, seed)
        w = proj.weight[:shared].float()
        pool.copy_(c)
        router.weight.copy_(2 * c @ w)
        if router.bias is not None:
            router.bias.copy_(-(c * c).sum(1))
        user.weight.copy_(proj.weight[shared:])
        routed = router(x.to(router.weight.dtype)).argmax(-1)
        energy = (kv * kv).sum().clamp(min=1e-12)
        stats[f"{name}_kmeans_rel_error"] = float(((kv - c[assign]) ** 2).sum() / energy)
        stats[f"{name}_router_rel_error"] = float(((kv - c[routed]) ** 2).sum() / energy)
    return stats
