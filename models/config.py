"""Typed configs, one per concern, validated on construction and serialisable to and from JSON.

The same objects are what a job's command line, a Serve YAML and a test build; a conflicting
setting fails here, at construction, with a message that names the fields involved.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from models.errors import InputError

T = TypeVar("T", bound="_JsonConfig")


class _JsonConfig:
    """to_dict / from_dict / to_json / from_json for a (possibly nested) config dataclass."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        values = typed_values(cls, d)
        return cls(**{k: _nested(cls, k, v) for k, v in values.items()})

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))


def _nested(cls: type, name: str, value: Any) -> Any:
    if name == "collective_kv" and isinstance(value, dict):
        return CollectiveKVConfig.from_dict(value)
    if isinstance(value, list):
        return tuple(value)
    return value


ITEM_INPUTS = ("text", "id", "text+id")  # RankerConfig.item_input
TEACHER_KINDS = ("causal", "cross")  # TeacherConfig.kind


def field_type(cls: type, name: str) -> type:
    """The type of ``cls``'s field ``name``, with ``None`` taken out of an optional one
    (``str | None`` -> str)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def typed_values(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` for ``cls``'s fields converted to their types - what a command line, a Serve
    config's ``args`` or a YAML file gives as text becomes the field's bool, int, float or
    str. Unknown names and values that do not convert are an ``InputError`` naming them."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise InputError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    out = {}
    for name, value in values.items():
        kind = field_type(cls, name)
        if value is None or kind not in (bool, int, float, str):
            out[name] = value
        elif kind is bool:
            text = str(value).lower()
            if text not in ("true", "false"):
                raise InputError(f"{name}: {value!r} is not true or false")
            out[name] = text == "true"
        else:
            try:
                out[name] = kind(value)
            except (TypeError, ValueError) as e:
                raise InputError(f"{name}: {value!r} is not a {kind.__name__}") from e
    return out


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its help line (what ``pipelines.common.cli`` shows in --help)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def _check(cond: bool, cls: str, msg: str) -> None:
    if not cond:
        raise InputError(f"{cls}: {msg}")


@dataclass(frozen=True)
class EncoderConfig(_JsonConfig):
    """The item text encoder: a Hugging Face AutoModel, mean-pooled to one vector per text."""

    model_dir: str | None = option(
        None, "a local Hugging Face model directory (default: the shipped MiniLM-L6-v2)"
    )
    max_length: int = option(128, "tokens per item text; longer texts are truncated (reported)")
    batch_size: int = option(64, "texts per forward pass")
    normalize: bool = option(True, "L2-normalise the pooled vector (MiniLM is trained so)")

    def __post_init__(self) -> None:
        _check(
            self.max_length > 0, "EncoderConfig", f"max_length must be > 0, got {self.max_length}"
        )
        _check(
            self.batch_size > 0, "EncoderConfig", f"batch_size must be > 0, got {self.batch_size}"
        )


@dataclass(frozen=True)
class CollectiveKVConfig(_JsonConfig):
    """Per-layer shared KV pools (CollectiveKV). Each cached token stores, per layer, one pool
    index for K and one for V plus ``user_dim`` fp16 numbers for each."""

    pool_size: int = option(1024, "M: entries in each layer's K pool and V pool")
    user_dim: int = option(1, "d_u: user-specific numbers per cached token for K and for V")
    peak_weight: float = option(0.01, "weight of the peak loss (-mean log p[top1])")
    balance_weight: float = option(0.01, "weight of the balance loss KL(mean p || uniform)")
    # an unshared side is the layer's plain projection, stored in full (kv_width fp16 a token)
    share_k: bool = option(True, "K comes from the pools (else stored in full)")
    share_v: bool = option(True, "V comes from the pools (else stored in full)")

    def __post_init__(self) -> None:
        _check(
            self.pool_size >= 2,
            "CollectiveKVConfig",
            f"pool_size must be >= 2, got {self.pool_size}",
        )
        _check(
            1 <= self.user_dim <= 64,
            "CollectiveKVConfig",
            f"user_dim must be in 1..64 (the method uses 1..8), got {self.user_dim}",
        )
        _check(
            self.peak_weight >= 0 and self.balance_weight >= 0,
            "CollectiveKVConfig",
            "loss weights must be >= 0",
        )
        _check(
            self.share_k or self.share_v,
            "CollectiveKVConfig",
            "share K, V or both (with neither shared it is the plain KV cache: no pools needed)",
        )

    @staticmethod
    def share_flags(share: str) -> dict[str, bool]:
        """``share_k`` / ``share_v`` for 'kv', 'k' or 'v' (what the pools carry)."""
        _check(
            share in ("kv", "k", "v"),
            "CollectiveKVConfig",
            f"share must be kv, k or v, got {share!r}",
        )
        return {"share_k": "k" in share, "share_v": "v" in share}

    @property
    def share(self) -> str:
        """'kv', 'k' or 'v': which of K and V come from the pools."""
        return "k" * self.share_k + "v" * self.share_v

    @property
    def index_bytes(self) -> int:
        """Bytes per stored pool index: uint16 while the pool has at most 65,536 entries."""
        return 2 if self.pool_size <= 65536 else 4


@dataclass(frozen=True)
class RankerConfig(_JsonConfig):
    """The personalized ranker: a Llama-style decoder over item-vector tokens.

    Attention widths follow Llama/Qwen: ``n_heads * head_dim`` for queries and
    ``n_kv_heads * head_dim`` (the KV width) for keys and values, independent of ``d_model``.
    """

    # the defaults are the measured recipe of the README's quality table (CPU-sized)
    item_dim: int = option(384, "width of the item vectors (MiniLM: 384; id: d_model)")
    d_model: int = option(64, "residual stream width")
    n_layers: int = option(2, "decoder layers")
    n_heads: int = option(8, "query heads")
    n_kv_heads: int = option(4, "key/value heads (grouped-query attention)")
    head_dim: int = option(64, "width of each head; the KV width is n_kv_heads x head_dim")
    ffn_dim: int = option(192, "SwiGLU hidden width")
    rope_theta: float = option(10000.0, "rotary position base")
    norm_eps: float = option(1e-6, "RMSNorm epsilon")
    attention_bias: bool = option(
        False, "q/k/v biases, as Qwen2-style decoders have (to start from their weights)"
    )
    feedback_classes: int = option(5, "rating buckets (from the dataset); unknown: its own")
    collective_kv: CollectiveKVConfig | None = option(None, "shared KV pools (None: plain KV)")
    dropout: float = option(
        0.2, "dropout on the input tokens and each block's outputs, in training"
    )
    item_input: str = option(
        "text+id",
        "text: encoder vectors; id: learned id embeddings (the baseline); text+id: encoder "
        "vectors plus a learned per-item residual starting at zero (unseen items: text alone)",
        choices=ITEM_INPUTS,
    )
    # trained complementary to the item prior: the prior's score is an offset on every logit,
    # so the ranker learns what the prior misses; the weight is the model's, not picked after
    prior_weight: float = option(
        0.0,
        "the item prior's weight in every score at the start of training with --item-prior, "
        "learned from there (0: a ranker trained without the prior)",
    )

    def __post_init__(self) -> None:
        c = "RankerConfig"
        for name in (
            "item_dim",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
        ):
            _check(getattr(self, name) > 0, c, f"{name} must be > 0, got {getattr(self, name)}")
        _check(
            self.n_heads % self.n_kv_heads == 0,
            c,
            f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        _check(
            self.head_dim % 2 == 0,
            c,
            f"head_dim must be even for rotary positions, got {self.head_dim}",
        )
        _check(
            self.feedback_classes >= 0,
            c,
            f"feedback_classes must be >= 0, got {self.feedback_classes}",
        )
        _check(0.0 <= self.dropout < 1.0, c, f"dropout must be in [0, 1), got {self.dropout}")
        _check(self.prior_weight >= 0, c, f"prior_weight must be >= 0, got {self.prior_weight}")
        _check(
            self.item_input in ITEM_INPUTS,
            c,
            f"item_input must be one of {', '.join(ITEM_INPUTS)}; got {self.item_input!r}",
        )
        if self.collective_kv is not None:
            _check(
                self.collective_kv.user_dim < self.kv_width,
                c,
                f"collective_kv.user_dim ({self.collective_kv.user_dim}) must be smaller than the "
                f"KV width n_kv_heads*head_dim ({self.kv_width})",
            )

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def reads_vectors(self) -> bool:
        """Whether the ranker needs the encoder's item table (set_item_table) to score."""
        return self.item_input != "id"


@dataclass(frozen=True)
class TeacherConfig(_JsonConfig):
    """The full-text teacher, one of two kinds (``kind``):

    - ``causal``: a causal LM over a prompt, scored by the logit of a "yes" token - the form vLLM
      serves with prefix caching. With ``model_dir`` None a small Llama is built locally (random
      init) with the tokenizer of the shipped MiniLM, so it runs on a CPU with nothing
      downloaded; a pretrained causal-LM directory (tokenizer + weights) plugs in through
      ``model_dir``.
    - ``cross``: a bidirectional encoder over the pair (candidate title, history titles),
      scored by a linear head - a cross-encoder. With ``model_dir`` None it starts from the
      shipped MiniLM's pretrained weights (``init_from_encoder``; False: its shape, random
      weights); a saved cross-encoder or any local BERT-style directory plugs in instead.
      ``d_model``, ``n_layers``, ``n_heads``, ``ffn_dim`` and ``yes_token`` do not apply.
    """

    kind: str = option(
        "causal",
        "causal: a small Llama on the MiniLM tokenizer, from scratch (vLLM serves it); cross: a "
        "cross-encoder fine-tuned from the pretrained MiniLM",
        choices=TEACHER_KINDS,
    )
    model_dir: str | None = option(None, "a local pretrained model directory (default: built)")
    d_model: int = option(128, "the local causal model's width (ignored with model_dir)")
    n_layers: int = option(2, "the local causal model's layers")
    n_heads: int = option(
        2, "the local causal model's heads (head size 64: what vLLM's CPU attention accepts)"
    )
    ffn_dim: int = option(256, "the local causal model's FFN width")
    init_from_encoder: bool = option(
        True,
        "causal: token embeddings from MiniLM's, projected to d_model (else random); cross: "
        "MiniLM's pretrained weights (else its shape, random)",
    )
    max_length: int = option(256, "prompt tokens; the oldest history is cut first")
    max_history: int = option(20, "most recent history titles in the prompt")
    yes_token: str = option("yes", "the causal model's answer token, scored by its logit")
    seed: int = option(0, "initialisation seed of the local model")

    def __post_init__(self) -> None:
        c = "TeacherConfig"
        _check(
            self.kind in TEACHER_KINDS,
            c,
            f"kind must be one of {', '.join(TEACHER_KINDS)}, got {self.kind!r}",
        )
        _check(self.max_length > 16, c, f"max_length must be > 16, got {self.max_length}")
        _check(self.max_history > 0, c, f"max_history must be > 0, got {self.max_history}")
        _check(
            self.d_model % self.n_heads == 0,
            c,
            f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})",
        )
