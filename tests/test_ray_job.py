"""prepare_data submitted with ``ray job submit`` to a ``ray start --head`` cluster, as the README
tells an operator to run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipelines.prepare_data import load_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def submit(
    ray_head: dict, *job_args: str, job: str = "prepare_data"
) -> subprocess.CompletedProcess:
    """``ray job submit --working-dir <repo> -- python -m pipelines.<job> <job_args>``."""
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
        f"pipelines.{job}",
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


def test_encode_items_as_a_ray_job_uses_the_cluster(ray_head, tmp_path):
    """A Ray Data job: under ray job submit it joins the head (RAY_ADDRESS) instead of starting
    its own Ray, and its actor pool runs there."""
    import polars as pl

    items = tmp_path / "items.csv"
    pl.DataFrame({"item_id": range(12), "title": [f"board game {i}" for i in range(12)]}).write_csv(
        items
    )
    seq = tmp_path / "seq.tsv"
    pl.DataFrame({"user_id": [1, 2], "item_ids": ["0 1 2 3", "4 5 6"]}).write_csv(
        seq, separator="\t"
    )
    out = tmp_path / "out"
    prep = submit(
        ray_head,
        "--dataset",
        "games",
        "--items",
        str(items),
        "--sequences",
        str(seq),
        "--negatives",
        "3",
        "--out",
        str(out),
    )
    assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-2000:]
    proc = submit(
        ray_head,
        "--dataset-uri",
        str(out / "datasets" / "games"),
        "--out",
        str(out),
        "--actors",
        "1",
        job="encode_items",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "joined the Ray cluster" in proc.stdout + proc.stderr
    summary = json.loads(
        [ln for ln in proc.stdout.splitlines() if ln.startswith('{"job": "encode_items"')][0]
    )
    assert (summary["encoded"], summary["errors"]) == (12, 0)
