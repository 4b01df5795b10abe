"""The full-text teacher: one full forward per candidate over text, where the ranker reads one
vector per item - what DuoLM distils from and measures against. Two kinds
(``TeacherConfig.kind``), the same interface (``prompts``, ``tokenize``, ``forward``, ``score``,
``save``; ``build_teacher`` picks one):

- ``TextTeacher`` (causal): a causal LM reads a prompt of the user's history titles (with
  feedback) and one candidate title; its score is the logit of the "yes" token at the end. A
  user's prompts share the history prefix, so vLLM serves it with prefix caching: the serving
  baseline. With ``model_dir`` None it is a small Llama built here (tokenizer of the shipped
  MiniLM), so it runs on a CPU with nothing downloaded; any local causal-LM directory plugs in.
- ``CrossEncoderTeacher`` (cross): the shipped MiniLM, pretrained, reads the pair (candidate
  title, history titles newest first) with full attention between the two, and a linear head on
  its pooled output is the score - a cross-encoder, the strongest text teacher that trains on a
  CPU: from-scratch causal LMs of the size a CPU trains stay weaker than the ranker. It has no
  shared prefix (every token sees the candidate), so vLLM does not serve it.

The teachers know nothing about datasets or Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.config import TeacherConfig
from models.encoder import default_model_dir

FEEDBACK_WORDS = {-1: "", 0: "hated", 1: "disliked", 2: "was neutral on", 3: "liked", 4: "loved"}


@dataclass(frozen=True)
class TeacherExample:
    """One prompt: the user's history (oldest first) with feedback buckets, one candidate."""

    history_titles: list[str]
    history_feedback: list[int]
    candidate_title: str


def examples_for(
    window: Sequence[int],
    feedback: Sequence[int],
    cuts: Sequence[int],
    candidates: Sequence[Sequence[int]],
    titles: Sequence[str],
) -> list[TeacherExample]:
    """One example per (cut, candidate), in that order: history = window[:t] of each cut point t,
    every candidate vid of that cut's row; ``titles`` maps vids to text."""
    out = []
    for t, row in zip(cuts, candidates, strict=True):
        hist = [titles[v] for v in window[:t]]
        fb = [int(f) for f in feedback[:t]]
        out.extend(TeacherExample(hist, fb, titles[c]) for c in row)
    return out


def build_prompt(ex: TeacherExample, max_history: int) -> str:
    """The teacher's prompt; the most recent ``max_history`` items, newest last."""
    titles = ex.history_titles[-max_history:]
    feedback = ex.history_feedback[-max_history:]
    lines = []
    for title, f in zip(titles, feedback, strict=True):
        word = FEEDBACK_WORDS.get(int(f), "")
        lines.append(f"- {title} ({word})" if word else f"- {title}")
    history = "\n".join(lines) if lines else "- (nothing yet)"
    return (
        f"A user interacted with these items, oldest first:\n{history}\n"
        f"Candidate: {ex.candidate_title}\n"
        "Will the user interact with the candidate next? Answer:"
    )


def cross_pair(ex: TeacherExample, max_history: int) -> tuple[str, str]:
    """The cross-encoder's input: (candidate title, the most recent ``max_history`` history
    titles with feedback, newest first), so that cutting the pair's end drops the oldest."""
    titles = ex.history_titles[-max_history:][::-1]
    feedback = ex.history_feedback[-max_history:][::-1]
    parts = []
    for title, f in zip(titles, feedback, strict=True):
        word = FEEDBACK_WORDS.get(int(f), "")
        parts.append(f"{title} ({word})" if word else title)
    return ex.candidate_title, "; ".join(parts) if parts else "(nothing yet)"


def yes_token_id(tokenizer, yes_token: str) -> int:
    """The id whose logit is the teacher's score: the first token of ``yes_token``."""
    ids = tokenizer(yes_token, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"the tokenizer has no token for yes_token {yes_token!r}")
    return ids[0]


def prompt_token_ids(tokenizer, prompts: list[str], max_length: int) -> list[list[int]]:
    """Each prompt's token ids, unpadded, cut from the left to ``max_length`` (the oldest
    history goes first) - what an engine that takes token ids (vLLM) is given; the same ids
    ``TextTeacher.tokenize`` pads into a batch."""
    tokenizer.truncation_side = "left"
    out = tokenizer(prompts, add_special_tokens=False, truncation=True, max_length=max_length)
    return [list(ids) for ids in out["input_ids"]]


class _Teacher(nn.Module):
    """What both kinds share: ``score`` = prompts -> tokenize -> forward, in batches."""

    def prompts(self, examples: list[TeacherExample]) -> list:
        raise NotImplementedError

    def tokenize(self, prompts: list) -> dict[str, Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def score(self, examples: list[TeacherExample], batch_size: int = 16) -> Tensor:
        """One logit per example, (N,) float32 on the CPU."""
        prompts = self.prompts(examples)
        out = [
            self.forward(self.tokenize(prompts[i : i + batch_size])).float().cpu()
            for i in range(0, len(prompts), batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0)


class TextTeacher(_Teacher):
    """Causal LM + tokenizer; ``score`` gives one logit per example."""

    def __init__(self, cfg: TeacherConfig | None = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

        self.cfg = cfg = cfg or TeacherConfig()
        if cfg.model_dir:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, local_files_only=True)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(
                default_model_dir(), local_files_only=True
            )
            torch.manual_seed(cfg.seed)
            self.model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=len(self.tokenizer),
                    hidden_size=cfg.d_model,
                    intermediate_size=cfg.ffn_dim,
                    num_hidden_layers=cfg.n_layers,
                    num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_heads,
                    max_position_embeddings=cfg.max_length,
                    pad_token_id=self.tokenizer.pad_token_id,
                    tie_word_embeddings=True,
                )
            )
            if cfg.init_from_encoder:
                self._init_embeddings_from_encoder()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.yes_id = yes_token_id(self.tokenizer, cfg.yes_token)
        self.model.eval()

    @torch.no_grad()
    def _init_embeddings_from_encoder(self) -> None:
        """Token embeddings from the MiniLM word embeddings (same tokenizer): centred, projected
        onto their top d_model principal components and scaled to the init's spread, so the
        teacher starts knowing which title words are alike."""
        from transformers import AutoModel

        words = AutoModel.from_pretrained(default_model_dir(), local_files_only=True)
        table = words.get_input_embeddings().weight.float()
        emb = self.model.get_input_embeddings().weight
        d = emb.shape[1]
        if table.shape[0] != emb.shape[0] or d > table.shape[1]:
            raise ValueError(
                f"encoder embeddings {tuple(table.shape)} do not fit the teacher's "
                f"{tuple(emb.shape)}"
            )
        centred = table - table.mean(0)
        _, _, v = torch.linalg.svd(centred, full_matrices=False)
        proj = centred @ v[:d].T
        emb.copy_(proj * (emb.std() / proj.std()))

    def prompts(self, examples: list[TeacherExample]) -> list[str]:
        return [build_prompt(ex, self.cfg.max_history) for ex in examples]

    def tokenize(self, prompts: list[str]) -> dict[str, Tensor]:
        """Left-padded and left-truncated (as ``prompt_token_ids``), so the question and
        candidate always survive."""
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"
        return self.tokenizer(
            prompts,
            add_special_tokens=False,
            padding=True,
            truncation=True,
            max_length=self.cfg.max_length,
            return_tensors="pt",
        )

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Tokenized prompts -> the "yes" logit at the last position, (B,)."""
        dev = next(self.model.parameters()).device
        mask = batch["attention_mask"].to(dev)
        # left padding: positions count from each prompt's first real token
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # only the last position's logits: the full (B, S, vocab) tensor would cost more than
        # the layers
        logits = self.model(
            input_ids=batch["input_ids"].to(dev),
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
        ).logits
        return logits[:, -1, self.yes_id]

    def save(self, path: str) -> None:
        """Hugging Face format: the directory loads back as ``TeacherConfig(model_dir=path)``."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


class CrossEncoderTeacher(_Teacher):
    """Pretrained bidirectional encoder + one-logit head over (candidate, history) pairs;
    ``score`` gives one logit per example. Saved and loaded in Hugging Face format
    (``AutoModelForSequenceClassification`` with one label)."""

    def __init__(self, cfg: TeacherConfig | None = None) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.cfg = cfg = cfg or TeacherConfig(kind="cross")
        src = cfg.model_dir or default_model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
        # from a plain encoder the head is new by design: Hugging Face's warning about it is noise
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            if cfg.model_dir or cfg.init_from_encoder:
                self.model = AutoModelForSequenceClassification.from_pretrained(
                    src, num_labels=1, local_files_only=True
                )
            else:
                torch.manual_seed(cfg.seed)
                shape = AutoConfig.from_pretrained(src, num_labels=1, local_files_only=True)
                self.model = AutoModelForSequenceClassification.from_config(shape)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.model.eval()

    def prompts(self, examples: list[TeacherExample]) -> list[tuple[str, str]]:
        return [cross_pair(ex, self.cfg.max_history) for ex in examples]

    def tokenize(self, pairs: list[tuple[str, str]]) -> dict[str, Tensor]:
        """Right-padded; past ``max_length`` the longer part is cut from its end first - nearly
        always the history, whose end is its oldest items - so the candidate survives whole."""
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "right"
        first = [a for a, _ in pairs]
        second = [b for _, b in pairs]
        return self.tokenizer(
            first,
            second,
            padding=True,
            truncation="longest_first",
            max_length=self.cfg.max_length,
            return_tensors="pt",
        )

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Tokenized pairs -> one logit per pair, (B,)."""
        dev = next(self.model.parameters()).device
        return self.model(**{k: v.to(dev) for k, v in batch.items()}).logits[:, 0]

    def save(self, path: str) -> None:
        """Hugging Face format: loads back as ``TeacherConfig(kind="cross", model_dir=path)``."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def build_teacher(cfg: TeacherConfig) -> TextTeacher | CrossEncoderTeacher:
    """The teacher ``cfg.kind`` names."""
    return CrossEncoderTeacher(cfg) if cfg.kind == "cross" else TextTeacher(cfg)
