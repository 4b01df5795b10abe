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
from artifacts.data import item_titles
from pipelines import encode_items, label_teacher, train_teacher
from pipelines.common import teachers
from tests.conftest import free_port
from tests.tiny import (
    TINY_TEACHER,
    base_texts,
    prepare,
    run_json,
    untrained_states,
    write_catalog,
    write_sequences,
)

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (make vllm-env)")
pytestmark = pytest.mark.vllm


def _vectors(summary: dict) -> np.ndarray:
    t = storage.read_table(summary["out"], "vectors.parquet").sort_by("vid")
    return np.stack(t.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32)


def test_encode_items_with_vllm_gives_the_hf_vectors(tiny, ray_local, capsys):
    args = ["--dataset-uri", tiny["dataset"], "--out", tiny["out"], "--actors", "1"]
    hf = run_json(capsys, encode_items.main, args)
    first = run_json(capsys, encode_items.main, [*args, "--engine", "vllm"])
    assert first["engine"] == "vllm" and first["encoder_tag"] != hf["encoder_tag"]
    assert first["encoded"] == hf["encoded"] == 60 and first["dim"] == hf["dim"] == 384
    # the same MiniLM, mean-pooled and normalised by vLLM: the same float16 vectors
    assert_close(_vectors(first), _vectors(hf), atol=2e-3, rtol=0)
    again = run_json(capsys, encode_items.main, [*args, "--engine", "vllm"])
    assert (again["encoded"], again["reused"]) == (0, 60)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, ray_local):
    """A tiny published teacher and CollectiveKV states on the tiny dataset (of an untrained
    ranker: these tests compare the teacher's engines, not the ranker)."""
    d = tmp_path_factory.mktemp("vllm")
    out = str(d / "out")
    ds = prepare(d, out, write_catalog(d, base_texts()), write_sequences(d))
    args = ["--dataset-uri", ds, "--out", out, "--run", "t", "--epochs", "1", *TINY_TEACHER]
    assert train_teacher.main(args) == 0
    return {
        "out": out,
        "dataset": ds,
        "teacher": train_teacher.teacher_uri(out, "t"),
        "states": untrained_states(ds, out),  # a build_user_states summary
    }


def test_label_teacher_with_vllm_gives_the_hf_logits(teacher, capsys):
    args = ["--dataset-uri", teacher["dataset"], "--teacher", teacher["teacher"], "--cuts", "2"]
    args += ["--negatives", "3", "--max-len", "10", "--actors", "1"]
    hf = run_json(capsys, label_teacher.main, [*args, "--out", teacher["out"] + "/hf"])
    vl = run_json(capsys, label_teacher.main, [*args, "--out", teacher["out"], "--engine", "vllm"])
    assert vl["engine"] == "vllm" and vl["prompts"] == hf["prompts"] == 40 * 8

    def table(s):
        t = storage.read_table(s["labels"], "labels.parquet")
        return pl.from_arrow(t).sort("user_id", maintain_order=True)

    a, b = table(hf), table(vl)
    assert a["candidates"].to_list() == b["candidates"].to_list()
    assert_close(
        torch.tensor(b["teacher_logits"].to_list()),
        torch.tensor(a["teacher_logits"].to_list()),
        atol=1e-3,
        rtol=0,
    )
    assert storage.read_marker(vl["labels"])["engine"] == "vllm"


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
    from pipelines import evaluate

    args = ["--dataset-uri", teacher["dataset"], "--out", teacher["out"], "--actors", "1"]
    ranker = storage.read_marker(teacher["states"]["user_states"])["checkpoint"]
    args += ["--checkpoint", ranker, "--teacher", teacher["teacher"]]
    hf = run_json(capsys, evaluate.main, [*args, "--report", "hf"])
    vl = run_json(capsys, evaluate.main, [*args, "--report", "vl", "--teacher-engine", "vllm"])

    def ranks(summary):
        t = storage.read_table(summary["report"], "per_user.parquet")
        return pl.from_arrow(t).sort("user_id")["teacher_sampled_rank"].to_list()

    assert ranks(vl) == ranks(hf) and len(ranks(hf)) == 40
    assert vl["teacher_sampled_ndcg10"] == hf["teacher_sampled_ndcg10"]
