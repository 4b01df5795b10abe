"""prepare_data submitted with ``ray job submit`` to a ``ray start --head`` cluster, as the README
tells an operator to run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipelines.prepare_data import load_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def submit(ray_head: dict, *job_args: str) -> subprocess.CompletedProcess:
    """``ray job submit --working-dir <repo> -- python -m pipelines.prepare_data <job_args>``."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [
        ray,
        "job",
        "submit",
        "--address",
        ray_head["address"],
        "--working-dir",
        REPO,
        "--",
        "python",
        "-m",
        "pipelines.prepare_data",
        *job_args,
    ]
    return subprocess.run(cmd, env=ray_head["env"], capture_output=True, text=True, timeout=300)


def test_prepare_data_as_a_ray_job(ray_head, data_dir, tmp_path):
    proc = submit(
        ray_head, "--dataset", "ml-latest-small", "--data-dir", data_dir, "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    summaries = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"job": "prepare_data"')]
    assert len(summaries) == 1
    summary = json.loads(summaries[0])
    assert (summary["users"], summary["interactions"]) == (610, 100_836)
    assert load_dataset(summary["out"])["splits"].height == 610


def test_failed_ray_job_reports_the_error(ray_head, tmp_path):
    proc = submit(ray_head, "--dataset", "no-such-set", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "unknown dataset 'no-such-set'" in proc.stdout + proc.stderr
