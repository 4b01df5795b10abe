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


def job_summary(proc: subprocess.CompletedProcess, job: str) -> dict:
    """The job's one-line JSON summary, after checking it ran on the submitted-to cluster."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "joined the Ray cluster" in out, f"{job} started its own Ray"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f'{{"job": "{job}"')]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0])


def test_ranker_and_collective_kv_chain_as_ray_jobs(ray_head, tmp_path):
    """train_ranker -> train_kv_pool (K shared only, the sharing option) -> build_user_states
    -> evaluate --user-states, each submitted with ``ray job submit`` to the head: Ray Train and
    the Ray Data actor pools run on the cluster, and the stored states are what the evaluation
    reads. (The teacher jobs start their Ray and their trainer the same way; their own test,
    tests/test_teacher_jobs.py, runs them on the embedded Ray.)"""
    from artifacts import data, states
    from models.collective_kv import state_bytes_per_token
    from models.config import CollectiveKVConfig
    from tests.tiny import (
        N_USERS,
        TINY_SHAPE,
        TINY_TRAIN,
        base_texts,
        prepare,
        write_catalog,
        write_sequences,
    )

    out = str(tmp_path / "out")
    ds = prepare(tmp_path, out, write_catalog(tmp_path, base_texts()), write_sequences(tmp_path))
    common = ["--dataset-uri", ds, "--out", out]
    base = job_summary(
        submit(
            ray_head,
            *common,
            *["--run", "base", "--item-input", "id", "--epochs", "1", *TINY_SHAPE],
            job="train_ranker",
        ),
        "train_ranker",
    )
    assert base["workers"] == 1 and not base["distilled"]
    fit = job_summary(
        submit(
            ray_head,
            *common,
            *["--checkpoint", base["checkpoint"], "--run", "ckv", "--share", "k"],
            *["--pool-size", "16", "--user-dim", "2", "--init-users", "40"],
            *["--init-tokens", "100", "--epochs", "1", "--max-steps", "2", *TINY_TRAIN],
            job="train_kv_pool",
        ),
        "train_kv_pool",
    )
    assert fit["share"] == "k" and fit["checkpoint"] == f"{out}/checkpoints/ckv"
    built = job_summary(
        submit(
            ray_head,
            *common,
            *["--checkpoint", fit["checkpoint"], "--actors", "1"],
            job="build_user_states",
        ),
        "build_user_states",
    )
    model, _ = data.load_checkpoint(fit["checkpoint"])
    ckv = model.cfg.collective_kv
    assert ckv == CollectiveKVConfig(pool_size=16, user_dim=2, share_v=False)
    per_token = state_bytes_per_token(ckv, 2, model.cfg.kv_width)
    assert per_token == 2 * ((2 + 2 * 2) + 2 * model.cfg.kv_width)  # V stored whole
    assert (built["users"], built["state_bytes"]) == (N_USERS, built["tokens"] * per_token)
    manifest, _ = states.read_states(built["user_states"])
    assert (
        manifest["share"] == "k"
        and [set(u) - {"layer"} for u in manifest["router_use"]]
        == [{"k_used", "k_use", "k_entropy_bits"}] * 2
    )
    ev = job_summary(
        submit(
            ray_head,
            *common,
            *["--user-states", built["user_states"], "--actors", "1"],
            job="evaluate",
        ),
        "evaluate",
    )
    assert ev["users"] == N_USERS
    # scored from the stored states, next to the uncompressed ranker the pools were fitted to
    for name in ("ranker", "uncompressed", "most_popular"):
        assert 0 <= ev[f"{name}_full_ndcg10"] <= ev[f"{name}_full_hr10"] <= 1
