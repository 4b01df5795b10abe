"""The jobs and the Serve app on a three-node Ray cluster (tests/cluster.py), as the operators'
guide runs them: every job with ``ray job submit``, the app with ``serve deploy``. Placement is
forced by resources, not left to luck: two actors or replicas of 0.75 CPU (or one CPU) cannot
share a one-CPU node, so the work lands on more than one node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def submit(cluster: dict, *job_args: str, job: str = "prepare_data") -> subprocess.CompletedProcess:
    """``ray job submit --working-dir <repo> -- python -m pipelines.<job> <job_args>``."""
    cmd = [os.path.join(BIN, "ray"), "job", "submit", "--address", cluster["address"]]
    cmd += ["--working-dir", REPO, "--", "python", "-m", f"pipelines.{job}", *job_args]
    return subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=300)


def job_summary(proc: subprocess.CompletedProcess, job: str) -> dict:
    """The job's one-line JSON summary, after checking it ran on the submitted-to cluster."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "joined the Ray cluster" in out, f"{job} started its own Ray"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f'{{"job": "{job}"')]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0])


def nodes_of(cluster: dict, class_part: str) -> set[str]:
    """The nodes that ran actors whose class name holds ``class_part`` (alive or finished), from
    the dashboard's State API (with the cluster's token)."""
    r = httpx.get(
        f"{cluster['address']}/api/v0/actors",
        params={"detail": "true", "limit": 10_000},
        headers=cluster["headers"],
        timeout=30,
    )
    assert r.status_code == 200, r.text[-2000:]
    found = r.json()["data"]["result"]["result"]
    return {a["node_id"] for a in found if class_part in (a.get("class_name") or "")}


def test_failed_ray_job_reports_the_error(ray_cluster, tmp_path):
    proc = submit(ray_cluster, "--dataset", "no-such-set", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "unknown dataset 'no-such-set'" in proc.stdout + proc.stderr


def test_the_cluster_refuses_whoever_lacks_its_token(ray_cluster):
    """Ray's token authentication on the head (the other tests here submit with the token):
    ``ray job submit`` with another token or none is refused, and so is the Jobs API over
    HTTP without the bearer token."""
    cmd = [os.path.join(BIN, "ray"), "job", "submit", "--address", ray_cluster["address"]]
    cmd += ["--", "echo", "ran"]
    wrong = dict(ray_cluster["env"], RAY_AUTH_TOKEN="0" * 64)
    none = {k: v for k, v in ray_cluster["env"].items() if k != "RAY_AUTH_TOKEN"}
    for env in (wrong, none):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "ran" not in proc.stdout, out[-2000:]
        assert "Unauthorized" in out or "authentication" in out.lower(), out[-2000:]
    url = f"{ray_cluster['address']}/api/jobs/"
    assert httpx.get(url, timeout=30).status_code in (401, 403)
    assert httpx.get(url, headers=ray_cluster["headers"], timeout=30).status_code == 200


@pytest.fixture(scope="module")
def chain(ray_cluster, tiny_trained, tmp_path_factory) -> dict:
    """train_kv_pool (K shared only, the sharing option) from the tiny chain's ranker ->
    build_user_states (two prefill actors), each submitted with ``ray job submit``: Ray Train
    and a Ray Data actor pool run on the cluster, and each job joins it (RAY_ADDRESS) instead
    of starting its own Ray. The jobs' summaries. (train_ranker runs the same training code
    in-process elsewhere, encode_items the same actor pools; evaluating from stored states is
    checked in tests/test_collective_kv_jobs.py.)"""
    from tests.tiny import TINY_TRAIN

    ds, base = tiny_trained["dataset"], tiny_trained["base"]
    out = str(tmp_path_factory.mktemp("cluster_chain") / "out")
    common = ["--dataset-uri", ds, "--out", out]
    fit = job_summary(
        submit(
            ray_cluster,
            *common,
            *["--checkpoint", base["checkpoint"], "--run", "ckv", "--share", "k"],
            *["--pool-size", "16", "--user-dim", "2", "--init-users", "40"],
            *["--init-tokens", "100", "--epochs", "1", "--max-steps", "2", *TINY_TRAIN],
            job="train_kv_pool",
        ),
        "train_kv_pool",
    )
    built = job_summary(
        submit(
            ray_cluster,
            *common,
            *["--checkpoint", fit["checkpoint"], "--actors", "2"],
            job="build_user_states",
        ),
        "build_user_states",
    )
    return {"fit": fit, "states": built, "out": out}


def test_ranker_and_collective_kv_chain_as_ray_jobs(ray_cluster, chain):
    """The chain's jobs ran on the cluster, and the stored states are what the pools and the
    sharing option make."""
    from artifacts import data, states
    from models.collective_kv import state_bytes_per_token
    from models.config import CollectiveKVConfig
    from tests.tiny import N_USERS

    fit, built = chain["fit"], chain["states"]
    assert fit["workers"] == 1
    assert fit["share"] == "k" and fit["checkpoint"] == f"{chain['out']}/checkpoints/ckv"
    model, _ = data.load_checkpoint(fit["checkpoint"])
    ckv = model.cfg.collective_kv
    assert ckv == CollectiveKVConfig(pool_size=16, user_dim=2, share_v=False)
    per_token = state_bytes_per_token(ckv, 2, model.cfg.kv_width)
    assert per_token == 2 * ((2 + 2 * 2) + 2 * model.cfg.kv_width)  # V stored whole
    assert (built["users"], built["state_bytes"]) == (N_USERS, built["tokens"] * per_token)
    # two prefill actors of one CPU each: one per node
    assert len(nodes_of(ray_cluster, "BuildStates")) == 2
    manifest, _ = states.read_states(built["user_states"])
    assert (
        manifest["share"] == "k"
        and [set(u) - {"layer"} for u in manifest["router_use"]]
        == [{"k_used", "k_use", "k_entropy_bits"}] * 2
    )


def serve_cli(cluster: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "serve"), *args, "--address", cluster["address"]]
    return subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=120)


def test_the_app_deployed_with_serve_deploy_ranks_across_nodes(ray_cluster, chain, tmp_path):
    """infra/serve_config.yaml pointed at the chain's states, with two Ranker replicas of 0.75
    CPU, deployed with ``serve deploy`` (the Serve REST API), ranks every user over HTTP."""
    config = yaml.safe_load(open(os.path.join(REPO, "infra", "serve_config.yaml")))
    port = free_port()
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"] |= {
        "manifest_uri": chain["states"]["user_states"],
        "ranker_min_replicas": 2,
        "ranker_max_replicas": 2,
        "ranker_num_cpus": 0.75,
    }
    app.pop("deployments", None)  # the replicas as the settings say (the file's are for one node)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    deployed = serve_cli(ray_cluster, "deploy", str(path))
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    try:
        deadline = time.time() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            # the Serve REST API that `serve status` reads: a failed deployment ends the wait
            apps = httpx.get(
                f"{ray_cluster['address']}/api/serve/applications/",
                headers=ray_cluster["headers"],
                timeout=10,
            )
            assert "DEPLOY_FAILED" not in apps.text, apps.text[-3000:]
            assert time.time() < deadline, "the app never became healthy: " + apps.text[-3000:]
            time.sleep(0.5)
        statuses = []
        with httpx.Client(timeout=60) as client:
            for user in range(40):
                r = client.post(
                    f"http://127.0.0.1:{port}/v1/rank",
                    json={"user_id": user, "candidate_item_ids": [1, 2, 3, 4, 5], "k": 3},
                )
                statuses.append(r.status_code)
        assert statuses == [200] * 40
        assert len(nodes_of(ray_cluster, "Ranker")) == 2  # 2 replicas x 0.75 CPU: one per node
    finally:
        serve_cli(ray_cluster, "shutdown", "-y")
