"""The teacher chain on the tiny dataset, on a real local Ray: train_teacher, label_teacher, and
train_ranker distilling from the labels."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from torch.testing import assert_close

from artifacts import storage
from artifacts.data import item_titles, user_sequences
from models.batches import training_batch
from models.errors import InputError
from models.ranker import distillation_loss
from pipelines import label_teacher, train_ranker, train_teacher
from pipelines.common import ranker_training, teachers
from tests.tiny import TINY_SHAPE, TINY_TEACHER, run_json


def test_distillation_loss_is_the_tempered_kl_to_the_teacher():
    teacher = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    assert float(distillation_loss(teacher, teacher)) == pytest.approx(0.0, abs=1e-7)
    assert float(distillation_loss(teacher + 3.0, teacher)) == pytest.approx(0.0, abs=1e-6)
    scores = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], requires_grad=True)
    for t in (1.0, 2.0):
        p = torch.softmax(teacher / t, -1)
        q = torch.softmax(scores.detach() / t, -1)
        expected = (p * (p / q).log()).sum(-1).mean() * t * t
        assert_close(distillation_loss(scores, teacher, t), expected)
    distillation_loss(scores, teacher).backward()
    # the gradient lowers the candidate the teacher likes less than the ranker does
    assert scores.grad[0, 1] > 0 and scores.grad[0, 0] < 0


def test_training_batch_takes_labelled_cuts_and_candidates_as_given():
    window, cands = np.array([5, 6, 7, 8]), np.array([6, 1, 2, 8, 3, 4])

    def batch(cuts):
        return training_batch(
            [window],
            [np.zeros(4, dtype=np.int64)],
            np.random.default_rng(0),
            n_items=10,
            max_len=5,
            cuts=2,
            negatives=2,
            given=([np.array(cuts)], [cands]),
        )

    tb = batch([1, 3])
    assert tb.candidates.tolist() == [cands.tolist()]
    assert tb.cut.tolist() == [[1, 1, 1, 3, 3, 3]]
    assert tb.history.vids.tolist() == [[5, 6, 7]]  # the whole window but its last item
    with pytest.raises(ValueError, match="do not fit a window of 4"):
        batch([1, 4])


def test_labelled_rows_grouped_by_length_keep_their_cuts_candidates_and_logits():
    """ranker_batches reorders a chunk of labelled rows into batches of similar lengths: each
    window still comes with its own cut points, candidates and teacher logits."""
    rng = np.random.default_rng(0)
    lengths = [3, 9, 4, 8, 2, 7]
    hist = [np.arange(10 * i, 10 * i + n) for i, n in enumerate(lengths)]
    cuts = [np.array([1, n - 1]) for n in lengths]
    cands = [np.concatenate([[h[1], 50, 51], [h[-1], 52, 53]]) for h in hist]
    rows = {
        "hist": hist,
        "hist_fb": [np.zeros(n, dtype=np.int64) for n in lengths],
        "cuts": cuts,
        "candidates": cands,
        "teacher_logits": [np.full(6, float(i)) for i in range(len(lengths))],
    }
    tc = ranker_training.TrainConfig(batch_size=2, cuts=2, negatives=2, max_len=10)
    seen, pairs = [], set()
    for tb in ranker_training.ranker_batches(rows, rng, tc, n_items=60):
        assert len(tb.history.lengths) == 2
        for b in range(2):
            i = int(tb.teacher[b, 0])  # whose logits these are
            n = int(tb.history.lengths[b])
            assert tb.history.vids[b, :n].tolist() == hist[i][:-1].tolist()
            assert tb.candidates[b].tolist() == cands[i].tolist()
            assert tb.cut[b].tolist() == np.repeat(cuts[i], 3).tolist()
            seen.append(i)
        pairs.add(tuple(sorted(lengths[int(tb.teacher[b, 0])] for b in range(2))))
    assert sorted(seen) == list(range(len(lengths)))
    assert pairs == {(2, 3), (4, 7), (8, 9)}  # neighbours in length


def test_a_sample_of_windows_keeps_each_windows_draws():
    seqs = pl.DataFrame(
        {
            "user_id": [1, 2, 3],
            "hist": [list(range(10, 22)), [3, 4, 5], list(range(30, 37))],
            "hist_fb": [[0] * 12, [1] * 3, [2] * 7],
        }
    )
    kw = dict(n_items=60, max_len=4, cuts=2, negatives=3, passes=2, seed=7)
    every = label_teacher.fixed_examples(seqs, **kw).to_pylist()
    some = label_teacher.fixed_examples(seqs, max_windows=3, **kw).to_pylist()
    n_windows = len(every) // 2  # two passes
    assert n_windows == 3 + 1 + 2 and len(some) == 2 * 3
    assert all(row in every for row in some)  # the same window, cuts and candidates as in all
    assert label_teacher.fixed_examples(seqs, max_windows=3, **kw).to_pylist() == some


def test_teacher_train_label_and_distil(tiny, ray_local, capsys):
    out, ds = tiny["out"], tiny["dataset"]
    base = ["--dataset-uri", ds, "--out", out, "--run", "t", *TINY_TEACHER]
    # (--resume is training.fit's and train_epochs', which every trainer shares: checked with
    # train_ranker in test_pipelines.py)
    trained = run_json(capsys, train_teacher.main, [*base, "--epochs", "2"])
    assert trained["parameters"] > 0
    assert (trained["epochs_run"], trained["best_epoch"] in (0, 1)) == (2, True)
    root = train_teacher.teacher_uri(out, "t")
    marker = storage.read_marker(root)
    assert marker["kind"] == "teacher_checkpoint"
    # a Hugging Face directory: config, weights and tokenizer, plus the prompt settings
    assert {"config.json", "teacher.json", "tokenizer.json"} <= set(marker["files"])
    assert any(name.endswith(".safetensors") for name in marker["files"])
    history = json.loads(storage.read_file(root, "metrics.json"))
    assert [h["epoch"] for h in history] == [0, 1] and history[0]["val_users"] == 8

    labels = run_json(
        capsys,
        label_teacher.main,
        ["--dataset-uri", ds, "--teacher", root, "--out", out, "--cuts", "2"]
        + ["--negatives", "3", "--max-len", "10", "--actors", "1"],
    )
    table = pl.from_arrow(storage.read_table(labels["labels"], "labels.parquet")).sort(
        "user_id", maintain_order=True
    )
    seqs = user_sequences(ds)
    assert labels["rows"] == table.height == seqs.height  # 7-item histories: one window each
    assert labels["prompts"] == table.height * 8
    for row in table.iter_rows(named=True):
        window, cuts, cands = row["hist"], row["cuts"], np.reshape(row["candidates"], (2, 4))
        assert len(row["teacher_logits"]) == 8 and all(1 <= t < len(window) for t in cuts)
        assert [window[t] for t in cuts] == cands[:, 0].tolist()  # the positive first
    # the stored logits are the teacher's scores of those prompts, recomputed here
    from models.teacher import examples_for

    row = table.row(0, named=True)
    with teachers.load_teacher(root) as teacher:
        again = teacher.score(
            examples_for(
                row["hist"],
                row["hist_fb"],
                row["cuts"],
                np.reshape(row["candidates"], (2, 4)),
                item_titles(ds),
            )
        )
    assert_close(again, torch.tensor(row["teacher_logits"]), atol=1e-4, rtol=0)

    distilled = run_json(
        capsys,
        train_ranker.main,
        ["--dataset-uri", ds, "--out", out, "--run", "d", "--item-input", "id"]
        + ["--teacher-labels", labels["labels"], "--epochs", "1", *TINY_SHAPE],
    )
    assert distilled["distilled"] and distilled["windows"] == table.height
    ckpt = ranker_training.checkpoint_uri(out, "d")
    assert storage.read_marker(ckpt)["teacher_labels"] == storage.resolve(labels["labels"])
    metrics = json.loads(storage.read_file(ckpt, "metrics.json"))
    assert metrics[0]["distill_loss"] > 0

    # the report puts the teacher beside the ranker, on the sampled protocol only
    from pipelines import evaluate

    ev = run_json(
        capsys,
        evaluate.main,
        ["--dataset-uri", ds, "--out", out, "--checkpoint", ckpt, "--teacher", root]
        + ["--actors", "1"],
    )
    assert 0 <= ev["teacher_sampled_ndcg10"] <= ev["teacher_sampled_hr10"] <= 1
    assert "teacher_full_ndcg10" not in ev
    per_user = pl.from_arrow(storage.read_table(ev["report"], "per_user.parquet"))
    ranks = per_user["teacher_sampled_rank"].to_numpy()
    assert len(ranks) == seqs.height and ranks.min() >= 0 and ranks.max() <= 10  # 10 negatives

    # a folder that is not a labels folder is refused before any training, naming it
    capsys.readouterr()
    bad = ["--dataset-uri", ds, "--out", out, "--run", "x", "--item-input", "id"]
    assert train_ranker.main([*bad, "--teacher-labels", root]) == 2
    assert f"{storage.resolve(root)} is not a label_teacher output" in capsys.readouterr().err
    assert not storage.exists(ranker_training.checkpoint_uri(out, "x"))


def test_cross_teacher_trains_labels_and_is_kept_off_vllm(tiny, ray_local, capsys):
    """The pretrained cross-encoder through the same jobs: published in Hugging Face format as a
    one-logit sequence classifier, labels that are its scores, and a clear refusal of the vLLM
    engine (which serves causal LMs only) before any actor starts."""
    out, ds = tiny["out"], tiny["dataset"]
    summary = run_json(
        capsys,
        train_teacher.main,
        ["--dataset-uri", ds, "--out", out, "--kind", "cross", "--max-length", "48"]
        + ["--max-history", "5", "--batch-size", "4", "--negatives", "3", "--val-users", "8"]
        + ["--max-len", "10", "--max-steps", "2", "--epochs", "1"],
    )
    assert summary["kind"] == "cross" and summary["run"].endswith("-cross-teacher")
    root = summary["checkpoint"]
    config = json.loads(storage.read_file(root, "config.json"))
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert len(config["id2label"]) == 1  # one logit: the score
    prompt = json.loads(storage.read_file(root, "teacher.json"))
    assert (prompt["kind"], prompt["max_length"], prompt["model_dir"]) == ("cross", 48, None)

    labels = run_json(
        capsys,
        label_teacher.main,
        ["--dataset-uri", ds, "--teacher", root, "--out", out, "--cuts", "1"]
        + ["--negatives", "3", "--max-len", "10", "--actors", "1", "--max-windows", "4"],
    )
    table = pl.from_arrow(storage.read_table(labels["labels"], "labels.parquet"))
    assert labels["rows"] == table.height == 4
    from models.teacher import CrossEncoderTeacher, examples_for

    row = table.row(0, named=True)
    with teachers.load_teacher(root) as teacher:
        assert isinstance(teacher, CrossEncoderTeacher)
        again = teacher.score(
            examples_for(
                row["hist"], row["hist_fb"], row["cuts"], [row["candidates"]], item_titles(ds)
            )
        )
    assert_close(again, torch.tensor(row["teacher_logits"]), atol=1e-4, rtol=0)

    # refused whether or not vLLM is installed here (without it, that is said first)
    with pytest.raises(InputError, match="is a cross teacher; the vllm engine serves causal-LM"):
        teachers.teacher_for_engine(root, "vllm")
    bad = ["--dataset-uri", ds, "--teacher", root, "--out", out, "--engine", "vllm"]
    assert label_teacher.main(bad) == 2
    assert "vllm" in capsys.readouterr().err
    assert storage.read_marker(labels["labels"])["engine"] == "hf"  # the labels stand
