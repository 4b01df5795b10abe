"""Item encoder (shipped MiniLM, offline) and the full-text teacher."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from models.config import EncoderConfig, TeacherConfig
from models.encoder import ItemEncoder
from models.teacher import (
    CrossEncoderTeacher,
    TeacherExample,
    TextTeacher,
    build_prompt,
    build_teacher,
    cross_pair,
)

TITLES = [
    "Toy Story (1995)",
    "Toy Story 2 (1999)",
    "Heat (1995)",
    "Casino (1995)",
    "The Lion King (1994)",
]


@pytest.fixture(scope="module")
def encoder() -> ItemEncoder:
    return ItemEncoder(EncoderConfig(batch_size=2))


def test_encoder_loads_offline_and_gives_unit_vectors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vecs = ItemEncoder().encode(TITLES)
    assert vecs.shape == (5, 384) and vecs.dtype == torch.float32
    assert_close(vecs.norm(dim=-1), torch.ones(5), atol=1e-5, rtol=0)
    sims = vecs @ vecs.T
    # a sequel is closer to its original than an unrelated film is
    assert sims[0, 1] > sims[0, 2] + 0.2


def test_encoder_is_deterministic_and_batch_invariant(encoder):
    batched = encoder.encode(TITLES)
    assert torch.equal(batched, encoder.encode(TITLES))
    single = torch.cat([encoder.encode([t]) for t in TITLES])
    assert_close(batched, single, atol=1e-5, rtol=0)


def test_encoder_reports_truncated_texts(encoder):
    short = ItemEncoder(EncoderConfig(max_length=8))
    tok = short.tokenize(["a b", "one two three four five six seven eight nine ten"])
    assert tok.truncated.tolist() == [False, True]
    assert tok.input_ids.shape[1] == 8


def test_encoder_names_a_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ItemEncoder(EncoderConfig(model_dir=str(tmp_path / "nope")))


def test_teacher_prompt_lists_recent_history_with_feedback_and_the_candidate():
    ex = TeacherExample(["A", "B", "C"], [4, -1, 0], "D")
    prompt = build_prompt(ex, max_history=2)
    assert "- A" not in prompt  # only the 2 most recent
    assert "- B\n- C (hated)" in prompt
    assert prompt.rstrip().endswith(
        "Candidate: D\nWill the user interact with the candidate next? Answer:"
    )


@pytest.mark.parametrize("kind", ["causal", "cross"])
def test_teacher_scores_are_batch_invariant_and_survive_a_save(kind, tmp_path):
    teacher = build_teacher(TeacherConfig(kind=kind, max_length=64))
    examples = [TeacherExample(TITLES[:k], [3] * k, TITLES[-1]) for k in range(1, 5)]
    batched = teacher.score(examples, batch_size=4)
    single = torch.cat([teacher.score([e]) for e in examples])
    assert batched.shape == (4,)
    assert_close(batched, single, atol=1e-5, rtol=0)
    # a saved teacher is a Hugging Face directory that plugs back in through model_dir
    teacher.save(str(tmp_path / "teacher"))
    again = build_teacher(
        TeacherConfig(kind=kind, model_dir=str(tmp_path / "teacher"), max_length=64)
    )
    assert type(again) is type(teacher)
    assert_close(again.score(examples), batched, atol=1e-5, rtol=0)


def test_teacher_truncates_old_history_first():
    teacher = TextTeacher(TeacherConfig(max_length=24, max_history=50))
    long = TeacherExample([f"film number {i}" for i in range(40)], [3] * 40, "Heat")
    tok = teacher.tokenize(teacher.prompts([long]))
    text = teacher.tokenizer.decode(tok["input_ids"][0])
    assert tok["input_ids"].shape[1] == 24
    assert "heat" in text and "answer" in text  # the question survives; the oldest items go
    assert "number 0 " not in text


def test_teacher_gradients_flow_for_training():
    teacher = TextTeacher(TeacherConfig(max_length=64)).train()
    batch = teacher.tokenize(teacher.prompts([TeacherExample(["A"], [3], "B")]))
    teacher(batch).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in teacher.parameters())


@pytest.fixture(scope="module")
def cross() -> CrossEncoderTeacher:
    return build_teacher(TeacherConfig(kind="cross", max_length=48, max_history=50))


def test_cross_pair_puts_the_candidate_first_and_the_newest_history_next():
    ex = TeacherExample(["A", "B", "C"], [4, -1, 0], "D")
    assert cross_pair(ex, max_history=2) == ("D", "C (hated); B")
    assert cross_pair(TeacherExample([], [], "D"), 5) == ("D", "(nothing yet)")


def test_cross_teacher_starts_from_pretrained_minilm(cross):
    from transformers import AutoModel

    from models.encoder import default_model_dir

    minilm = AutoModel.from_pretrained(default_model_dir(), local_files_only=True)
    ours = cross.model.base_model
    for name in ("embeddings.word_embeddings.weight", "encoder.layer.5.output.dense.weight"):
        assert torch.equal(ours.get_parameter(name), minilm.get_parameter(name)), name
    random = build_teacher(TeacherConfig(kind="cross", init_from_encoder=False))
    assert not torch.equal(random.model.base_model.get_parameter(name), minilm.get_parameter(name))


def test_cross_teacher_cuts_the_oldest_history_and_keeps_the_candidate(cross):
    long = TeacherExample([f"film number {i}" for i in range(40)], [3] * 40, "Heat")
    tok = cross.tokenize(cross.prompts([long]))
    text = cross.tokenizer.decode(tok["input_ids"][0])
    assert tok["input_ids"].shape[1] == 48
    assert text.startswith("[CLS] heat [SEP] film number 39 ( liked )")
    assert "number 0 " not in text and text.endswith("[SEP]")


def test_cross_teacher_fine_tunes_to_a_text_rule():
    """A rule only the text tells: the positive is the candidate that repeats the last history
    title. A few steps of the listwise loss must learn it from the pretrained start."""
    torch.manual_seed(0)
    teacher = build_teacher(TeacherConfig(kind="cross", max_length=32)).train()
    opt = torch.optim.AdamW(teacher.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        examples = []
        for _ in range(4):
            order = torch.randperm(len(TITLES), generator=gen).tolist()
            hist, pos, negs = TITLES[order[0]], TITLES[order[0]], order[1:4]
            examples += [TeacherExample([hist], [3], c) for c in [pos] + [TITLES[i] for i in negs]]
        logits = teacher(teacher.tokenize(teacher.prompts(examples))).view(4, 4)
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    losses = [step() for _ in range(20)]
    assert sum(losses[:4]) / 4 > 1.2  # about log 4 = 1.39 at the start: the head is new
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4


def test_teacher_config_rejects_an_unknown_kind():
    from models.errors import InputError

    with pytest.raises(InputError, match="kind must be one of causal, cross"):
        TeacherConfig(kind="seq2seq")
    assert TeacherConfig.from_json(TeacherConfig().to_json()).kind == "causal"
