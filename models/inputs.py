"""What the ranker reads and keeps: ragged histories, one-token events, the plain and the
CollectiveKV caches, and what a forward returns. Plain dataclasses over tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.collective_kv import LayerState


@dataclass
class History:
    """A batch of ragged histories, right-padded. vids, feedback (B, T) long (padding: vid -1,
    feedback -1 = unknown); lengths (B,) = real items per user."""

    vids: Tensor
    feedback: Tensor
    lengths: Tensor

    @staticmethod
    def from_lists(
        vids: list[list[int]],
        feedback: list[list[int]] | None = None,
        device=None,
    ) -> History:
        b, t = len(vids), max((len(v) for v in vids), default=0)

        def pad(rows, fill):
            out = torch.full((b, t), fill, dtype=torch.long, device=device)
            for i, r in enumerate(rows):
                out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            return out

        fb = feedback if feedback is not None else [[-1] * len(v) for v in vids]
        return History(
            vids=pad(vids, -1),
            feedback=pad(fb, -1),
            lengths=torch.tensor([len(v) for v in vids], dtype=torch.long, device=device),
        )


@dataclass
class Event:
    """One new history item per user: vid, feedback (B,) long."""

    vid: Tensor
    feedback: Tensor


@dataclass
class KVCache:
    """Plain cache: per layer k, v (B, Hkv, L, D) with rotary applied; ``lengths`` (B,) counts
    valid tokens including BOS (so a user's next token goes to position ``lengths``)."""

    k: list[Tensor]
    v: list[Tensor]
    lengths: Tensor

    def valid(self) -> Tensor:
        return torch.arange(self.k[0].shape[2], device=self.lengths.device) < self.lengths[:, None]


@dataclass
class CompressedCache:
    """CollectiveKV cache: per layer a LayerState (B, L, ...), position-free; ``lengths`` as in
    KVCache."""

    layers: list[LayerState]
    lengths: Tensor

    def nbytes(self) -> int:
        return sum(s.nbytes(self.lengths) for s in self.layers)


Cache = KVCache | CompressedCache


@dataclass
class RankerOutput:
    scores: Tensor  # (B, N); padded candidates -inf
    aux_loss: Tensor  # CollectiveKV peak + balance (0 without CollectiveKV)
    # (B, T, n_items) with ``catalog=True`` and a user token: column t-1 scores every item as
    # the next one after the first t history items (<u_t, c>); (R, n_items) for the prefixes a
    # (B, T) mask chose; None otherwise
    catalog: Tensor | None = None


@dataclass
class Prefill:
    """What a prefill computes: K/V on the fly (with gradients), the compressed state
    (CollectiveKV only; it expands to the same K/V), the aux loss, final normed hidden states."""

    kv: KVCache
    state: CompressedCache | None
    aux: Tensor
    hidden: Tensor
