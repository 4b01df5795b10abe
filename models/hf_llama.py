"""Weights in Hugging Face Llama naming, both ways.

The ranker's decoder uses Llama's module names (``layers.{i}.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...), so export is a prefix and import is its inverse. This lets a
pretrained Llama/Qwen checkpoint initialise the ranker on a GPU cluster, and lets the
non-CollectiveKV ranker run in any Llama runtime (vLLM included) as a baseline, fed with
``inputs_embeds``. Ranker-only parts (adapter, feedback and candidate embeddings, BOS, score
head, CollectiveKV) are not Llama weights and stay in kvrank's own checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.ranker import Ranker

DECODER_PREFIXES = ("layers.", "norm.")


def llama_config(ranker: Ranker, vocab_size: int = 2) -> dict[str, Any]:
    """kwargs for ``transformers.LlamaConfig`` describing the ranker's decoder.

    The ranker has no text vocabulary; ``vocab_size`` sizes the (unused) token embedding that
    Llama checkpoints must carry.
    """
    c = ranker.cfg
    return {
        "vocab_size": vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def export_llama(ranker: Ranker, vocab_size: int = 2) -> dict[str, Tensor]:
    """The decoder's weights as a Llama ``LlamaForCausalLM``-style state dict ("model." names),
    with zero token embeddings and LM head of ``vocab_size`` rows."""
    out = {
        f"model.{k}": v.detach().clone()
        for k, v in ranker.state_dict().items()
        if k.startswith(DECODER_PREFIXES) and ".ckv." not in k
    }
    d = ranker.cfg.d_model
    out["model.embed_tokens.weight"] = torch.zeros(vocab_size, d)
    out["lm_head.weight"] = torch.zeros(vocab_size, d)
    return out


def import_llama(ranker: Ranker, state: dict[str, Tensor]) -> list[str]:
    """Load decoder weights from a Llama/Qwen state dict ("model." or bare names). Returns the
    ranker keys that the checkpoint did not provide (ranker-only parts, to train)."""
    ours = ranker.state_dict()
    loaded = {}
    for k, v in state.items():
        name = k.removeprefix("model.")
        if not name.startswith(DECODER_PREFIXES):
            continue
        if name not in ours:
            raise KeyError(f"checkpoint weight {k} has no place in the ranker")
        if ours[name].shape != v.shape:
            raise ValueError(
                f"{k}: checkpoint shape {tuple(v.shape)} != ranker {tuple(ours[name].shape)}"
            )
        loaded[name] = v
    ranker.load_state_dict(loaded, strict=False)
    return sorted(set(ours) - set(loaded))
