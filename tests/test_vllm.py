"""The vLLM engine paths, on vLLM's CPU build (``make vllm-env``; ``make test`` runs this file
in .venv-vllm, and it is skipped where vLLM is not installed): catalog encoding through
``ray.data.llm`` gives the Hugging Face engine's vectors, teacher labels through vLLM give the
HF teacher's logits, and the teacher served by vLLM (prefix caching) ranks over real HTTP as
the HF teacher scores."""

from __future__ import annotations

import httpx
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
from tests.conftest import free_port
from tests.tiny import (
    base_texts,
    prepare,
    run_json,
    untrained_states,
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
    """A tiny published teacher and CollectiveKV states on the tiny dataset, both untrained:
    these tests compare the teacher's engines, not what the models learnt (training the teacher
    is checked in test_teacher_jobs.py)."""
    d = tmp_path_factory.mktemp("vllm")
    out = str(d / "out")
    ds = prepare(d, out, write_catalog(d, base_texts()), write_sequences(d))
    return {
        "out": out,
        "dataset": ds,
        "teacher": untrained_teacher(ds, out),
        "states": untrained_states(ds, out),  # a build_user_states summary
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


def test_the_teacher_served_by_vllm_ranks_as_the_hf_teacher_scores(teacher, capsys):
    from ray import serve

    from artifacts import states
    from benchmarks.serve_baselines import APP_NAME, ROUTE_PREFIX, build_baselines
    from models.teacher import TeacherExample
    from services.app import build_app

    built = teacher["states"]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = {"manifest_uri": built["user_states"], "shards": 1}
    try:
        serve.run(build_app(settings), name="kvrank", route_prefix="/")
        baselines = build_baselines(
            built["user_states"],
            shards=1,
            full=False,
            teacher_uri=teacher["teacher"],
            teacher_cpus=0.5,
        )
        serve.run(baselines, name=APP_NAME, route_prefix=ROUTE_PREFIX)
        _, table = states.read_states(built["user_states"])
        row = table.to_pylist()[5]
        items = [5, 17, 23, 42, 8, 31]
        body = {"user_id": row["user_id"], "candidate_item_ids": items, "k": 6}
        r = httpx.post(
            f"http://127.0.0.1:{port}{ROUTE_PREFIX}/v1/rank_teacher", json=body, timeout=120
        )
        assert r.status_code == 200, r.text
        got = {x["item_id"]: x["score"] for x in r.json()["items"]}
    finally:
        serve.shutdown()
    titles = item_titles(teacher["dataset"])
    vid_of = dict(
        zip(
            *storage.read_table(teacher["dataset"], "items.parquet")
            .select(["item_id", "vid"])
            .to_pydict()
            .values(),
            strict=True,
        )
    )
    hist = [titles[v] for v in row["hist"]]
    examples = [TeacherExample(hist, row["hist_fb"], titles[vid_of[i]]) for i in items]
    with teachers.load_teacher(teacher["teacher"]) as hf:
        want = hf.score(examples)
    assert_close(torch.tensor([got[i] for i in items]), want, atol=1e-3, rtol=0)
    scores = [x["score"] for x in r.json()["items"]]
    assert scores == sorted(scores, reverse=True)


def test_evaluate_scores_the_teacher_with_vllm_as_with_hf(teacher, capsys):
    """evaluate's teacher ranks through vLLM are the HF teacher's ranks of the same sampled
    candidates (the HF engine's pass is checked in test_teacher_jobs.py)."""
    from pipelines import evaluate

    args = ["--dataset-uri", teacher["dataset"], "--out", teacher["out"], "--actors", "1"]
    ranker = storage.read_marker(teacher["states"]["user_states"])["checkpoint"]
    args += ["--checkpoint", ranker, "--teacher", teacher["teacher"]]
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
