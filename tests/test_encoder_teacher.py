"""Item encoder (shipped MiniLM, offline) and the full-text teacher."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from models.config import EncoderConfig, TeacherConfig
from models.encoder import ItemEncoder
from models.teacher import TeacherExample, TextTeacher, build_prompt

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


def test_teacher_scores_are_batch_invariant_and_survive_a_save(tmp_path):
    teacher = TextTeacher(TeacherConfig(max_length=64))
    examples = [TeacherExample(TITLES[:k], [3] * k, TITLES[-1]) for k in range(1, 5)]
    batched = teacher.score(examples, batch_size=4)
    single = torch.cat([teacher.score([e]) for e in examples])
    assert batched.shape == (4,)
    assert_close(batched, single, atol=1e-5, rtol=0)
    # a saved teacher is a Hugging Face directory that plugs back in through model_dir
    teacher.save(str(tmp_path / "teacher"))
    again = TextTeacher(TeacherConfig(model_dir=str(tmp_path / "teacher"), max_length=64))
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
