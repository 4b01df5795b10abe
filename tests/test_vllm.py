"""The vLLM engine paths, on vLLM's CPU build (``make vllm-env``; ``make test`` runs this file
in .venv-vllm, and it is skipped where vLLM is not installed): catalog encoding through
``ray.data.llm`` gives the Hugging Face engine's vectors, teacher labels through vLLM give the
HF teacher's logits, the teacher baseline's Serve deployment (vLLM's async engine, prefix
caching) ranks as the HF teacher scores, and evaluate's teacher ranks through vLLM are the HF
teacher's."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from torch.testing import assert_close

from artifacts import storage
from artifacts.data import encoder_tag, item_titles
from pipelines import encode_items, label_teacher
from pipelines.common import teachers
from pipelines.encode_items import clean_text
from tests.tiny import (
    base_texts,
    prepare,
    run_json,
    untrained_ranker,
    untrained_teacher,
    write_catalog,
    write_sequences,
)

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (make vllm-env)")
pytestmark = pytest.mark.vllm


def _vectors(summary: dict) -> np.ndarray:
    t = storage.read_table(summary["out"], "vectors.parquet").sort_by("vid")
    return np.stack(t.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32)


def test_encode_items_with_vllm_gives_the_hf_vectors(tiny, ray_local, capsys):
    """The vLLM engine's vectors are the HF encoder's of the same texts (the HF engine's job is
    checked in test_pipelines.py), under their own encoder tag, and re-encode nothing again."""
    from models.config import EncoderConfig
    from models.encoder import ItemEncoder

    args = ["--dataset-uri", tiny["dataset"], "--out", tiny["out"], "--actors", "1"]
    first = run_json(capsys, encode_items.main, [*args, "--engine", "vllm"])
    assert first["engine"] == "vllm" and first["encoder_tag"] != encoder_tag(EncoderConfig(), "hf")
    assert first["encoded"] == 60 and first["dim"] == 384
    items = storage.read_table(tiny["dataset"], "items.parquet").sort_by("vid")
    texts = [clean_text(t) for t in items.column("text").to_pylist()]
    encoder = ItemEncoder(EncoderConfig())
    with torch.no_grad():
        want = encoder(encoder.tokenize(texts)).float().numpy().astype(np.float16)
    # the same MiniLM, mean-pooled and normalised by vLLM: the same float16 vectors
    assert_close(_vectors(first), want.astype(np.float32), atol=2e-3, rtol=0)
    again = run_json(capsys, encode_items.main, [*args, "--engine", "vllm"])
    assert (again["encoded"], again["reused"]) == (0, 60)


def test_the_cpu_engines_compile_nothing():
    """On CPUs the engines run eagerly, and vLLM's sampler helper that torch.compile would build
    as C++ at the first teacher engine of a fresh machine (~35 s) stays a plain function."""
    from pipelines.common.vllm_engine import require_vllm

    if torch.cuda.is_available():
        pytest.skip("the CPU build's settings")
    require_vllm()
    from vllm.v1.sample.ops import logprobs

    assert torch._dynamo.config.disable
    assert not hasattr(logprobs.batched_count_greater_than, "_torchdynamo_orig_callable")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, ray_local):
    """A tiny published teacher and ranker on the tiny dataset, both untrained:
    these tests compare the teacher's engines, not what the models learnt (training the teacher
    is checked in test_teacher_jobs.py)."""
    d = tmp_path_factory.mktemp("vllm")
    out = str(d / "out")
    ds = prepare(d, out, write_catalog(d, base_texts()), write_sequences(d))
    return {
        "out": out,
        "dataset": ds,
        "teacher": untrained_teacher(ds, out),
        "ranker": untrained_ranker(ds, out),
    }


def test_label_teacher_with_vllm_gives_the_hf_logits(teacher, capsys):
    """The vLLM engine's labels are the HF teacher's scores of the same prompts (the HF job's
    own labels are checked the same way in test_teacher_jobs.py)."""
    from models.teacher import examples_for

    args = ["--dataset-uri", teacher["dataset"], "--teacher", teacher["teacher"], "--cuts", "2"]
    args += ["--negatives", "3", "--max-len", "10", "--actors", "1"]
    vl = run_json(capsys, label_teacher.main, [*args, "--out", teacher["out"], "--engine", "vllm"])
    assert vl["engine"] == "vllm" and vl["prompts"] == 40 * 8
    assert storage.read_marker(vl["labels"])["engine"] == "vllm"
    table = pl.from_arrow(storage.read_table(vl["labels"], "labels.parquet"))
    titles = item_titles(teacher["dataset"])
    examples = [
        ex
        for row in table.iter_rows(named=True)
        for ex in examples_for(
            row["hist"],
            row["hist_fb"],
            row["cuts"],
            np.reshape(row["candidates"], (2, 4)),
            titles,
        )
    ]
    with teachers.load_teacher(teacher["teacher"]) as hf:
        want = hf.score(examples)
    got = torch.tensor(table["teacher_logits"].to_list()).reshape(-1)
    assert_close(got, want, atol=1e-3, rtol=0)


def test_the_teacher_deployment_on_vllm_ranks_as_the_hf_teacher_scores(teacher):
    """The teacher baseline's deployment (vLLM's async engine, a user's prompts sharing the
    cached history prefix) ranks a user's candidates as the HF teacher scores them. It is called
    through its Serve handle: the baselines' HTTP routes in front of it, and the store they read
    the user from, are checked over HTTP with the full-forward baseline in test_serve.py."""
    from ray import serve

    from artifacts.data import user_sequences
    from benchmarks.serve_baselines import TeacherRanker
    from models.teacher import TeacherExample

    row = user_sequences(teacher["dataset"]).row(5, named=True)  # a state's hist and hist_fb
    vids = [5, 17, 23, 42, 8, 31]
    deployment = TeacherRanker.options(ray_actor_options={"num_cpus": 0.5})
    serve.start(proxy_location="Disabled")  # called by its handle: no HTTP proxy
    try:
        handle = serve.run(
            deployment.bind(teacher["dataset"], teacher["teacher"]),
            name="teacher",
            route_prefix=None,
        )
        top, scores = handle.rank.remote((row, vids, 6)).result(timeout_s=120)
    finally:
        serve.shutdown()
    titles = item_titles(teacher["dataset"])
    hist = [titles[v] for v in row["hist"]]
    examples = [TeacherExample(hist, row["hist_fb"], titles[v]) for v in vids]
    with teachers.load_teacher(teacher["teacher"]) as hf:
        want = hf.score(examples)
    got = dict(zip(top, scores, strict=True))
    assert sorted(top) == sorted(vids) and scores == sorted(scores, reverse=True)
    assert_close(torch.tensor([got[v] for v in vids]), want, atol=1e-3, rtol=0)


def test_evaluate_scores_the_teacher_with_vllm_as_with_hf(teacher, capsys):
    """evaluate's teacher ranks through vLLM are the HF teacher's ranks of the same sampled
    candidates (the HF engine's pass is checked in test_teacher_jobs.py)."""
    from pipelines import evaluate

    args = ["--dataset-uri", teacher["dataset"], "--out", teacher["out"], "--actors", "1"]
    args += ["--checkpoint", teacher["ranker"], "--teacher", teacher["teacher"]]
    vl = run_json(capsys, evaluate.main, [*args, "--report", "vl", "--teacher-engine", "vllm"])
    got = pl.from_arrow(storage.read_table(vl["report"], "per_user.parquet")).sort("user_id")

    users = evaluate.eval_users(teacher["dataset"], None, 0).sort("user_id")
    with teachers.load_teacher(teacher["teacher"]) as hf:
        want = teachers.sampled_ranks(
            hf,
            users["input"].to_list(),
            users["input_fb"].to_list(),
            users["test"].to_list(),
            users["negatives"].to_list(),
            item_titles(teacher["dataset"]),
            batch_size=128,
        )
    assert got["user_id"].to_list() == users["user_id"].to_list() and len(want) == 40
    assert got["teacher_sampled_rank"].to_list() == want.tolist()
