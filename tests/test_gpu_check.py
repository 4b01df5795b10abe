"""benchmarks.gpu_check on the CPU, so the script the GPU machines run cannot rot between loans."""

from __future__ import annotations

import json

from benchmarks import gpu_check
from models.ranker import Ranker


def test_the_gpu_check_runs_on_the_cpu_and_reports_every_section(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert summary["ok"] is report["ok"] is True
    sizes = gpu_check.SIZES["cpu"]
    assert [(r["history_length"], r["candidates"]) for r in report["mis"]] == [
        (t, n) for t in sizes["lengths"] for n in sizes["candidates"]
    ]
    assert all(r["scores_per_s"] > 0 and 0 < r["share_of_peak"] for r in report["mis"])
    assert 0 < report["round_trip_s"] < min(r["seconds"] for r in report["mis"])
    (batch,) = report["batch"]
    assert batch["users"] == 32 and 0 < batch["expand_share"] < 1
    # each state token is 2 layers x (two uint16 indices + 2 fp16 user numbers at d_u 1)
    assert batch["state_bytes"] == batch["tokens"] * 2 * (2 * 2 + 2 * 2)
    assert report["train"]["windows_per_s"] > 0 and 0 < report["train"]["real_token_share"] < 1
    checks = report["checks"]
    assert checks["mis_equals_each_candidate_alone"]["ok"] is True
    assert checks["expand_of_compressed_equals_kv_on_the_fly"]["ok"] is True
    assert checks["graph_replay_equals_eager"] == {"ok": None, "why": "no CUDA"}


def test_the_gpu_check_fails_when_mis_departs_from_scoring_alone(tmp_path, monkeypatch, capsys):
    reference = Ranker.score_reference
    monkeypatch.setattr(Ranker, "score_reference", lambda self, h, c: reference(self, h, c) + 1e-2)
    # the timed sections are the test above's; here only the checks and the exit code count
    row = {"scores_per_s": 1.0}
    monkeypatch.setattr(gpu_check, "mis_rows", lambda device, sizes, peak, checks: [row])
    monkeypatch.setattr(gpu_check, "batch_rows", lambda device, sizes: [row])
    monkeypatch.setattr(gpu_check, "train_row", lambda device, steps: {"windows_per_s": 1.0})
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert report["ok"] is False
    mis = report["checks"]["mis_equals_each_candidate_alone"]
    assert mis["ok"] is False and mis["max_abs_diff"] > 1e-4
    assert report["checks"]["expand_of_compressed_equals_kv_on_the_fly"]["ok"] is True
