"""Building blocks of the ranker: RMSNorm, rotary positions, SwiGLU, and the two attention
kernels - causal prefill attention and the multi-item-scoring (MIS) fast path.

Shapes use B batch, H query heads, Hkv KV heads (G = H / Hkv queries per KV head), L cached
tokens, N new tokens, D head dim. Conventions match Hugging Face Llama (RMSNorm in fp32, rotary
with the rotate-half layout), so weights move between the two without changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), Llama's MLP with its weight names."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin for integer ``positions`` of any shape (...,) -> (..., head_dim) each."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (..., D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, heads, S, D) by cos/sin of shape (B, S, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, S, heads*D) -> (B, heads, S, D)."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, heads, S, D) -> (B, S, heads*D)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Dense-mask attention with grouped KV heads.

    q (B, H, S, D); k, v (B, Hkv, S_k, D); mask (B, S, S_k) bool, True = may attend.
    Every query row must allow at least one key. Returns (B, H, S, D).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))


def mis_attention(
    q: Tensor, k_hist: Tensor, v_hist: Tensor, hist_valid: Tensor, k_new: Tensor, v_new: Tensor
) -> Tensor:
    """Multi-item scoring attention: each new token attends to the cached history and to itself,
    never to another new token - without materialising an N x N mask.

    q (B, H, N, D); k_hist, v_hist (B, Hkv, L, D); hist_valid (B, L) bool, or (B, N, L) when
    each new token sees its own prefix of the history (training at several cut points);
    k_new, v_new (B, Hkv, N, D). Returns (B, H, N, D).

    The grouped query heads are folded into the row dimension so one matmul per KV head covers
    all G*N queries, and the self term is a row-wise dot product appended as one extra logit.
    """
    b, h, n, d = q.shape
    hkv = k_hist.shape[1]
    g = h // hkv
    scale = d**-0.5
    qg = q.view(b, hkv, g, n, d)
    hist_logits = torch.matmul(qg.reshape(b, hkv, g * n, d), k_hist.transpose(-1, -2)) * scale
    if hist_valid.ndim == 2:
        hist_logits = hist_logits.masked_fill(~hist_valid[:, None, None, :], float("-inf"))
    else:
        length = k_hist.shape[2]
        hist_logits = (
            hist_logits.view(b, hkv, g, n, length)
            .masked_fill(~hist_valid[:, None, None], float("-inf"))
            .view(b, hkv, g * n, length)
        )
    self_logit = (qg * k_new.unsqueeze(2)).sum(-1).reshape(b, hkv, g * n, 1) * scale
    probs = torch.softmax(torch.cat([hist_logits, self_logit], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :-1], v_hist)  # (B, Hkv, G*N, D)
    out = out.view(b, hkv, g, n, d) + probs[..., -1:].view(b, hkv, g, n, 1) * v_new.unsqueeze(2)
    return out.reshape(b, h, n, d)
