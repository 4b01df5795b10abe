"""Shared fixtures: the data directory, a local Ray, and an S3 endpoint (moto) on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from pipelines.common import sources

# the slow tier: every test that starts a Ray (embedded or a cluster) or needs the tiny trained
# chain; `make test-fast` runs the rest (`-m "not slow"`)
RAY_FIXTURES = {"ray_local", "ray_head", "tiny_trained"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def data_dir() -> str:
    root = sources.data_dir(None)
    if root is None or not os.path.isdir(os.path.join(root, "ml-latest-small")):
        pytest.fail("no data directory: put shared/data beside the checkout or set KVRANK_DATA_DIR")
    return root


@pytest.fixture(scope="session")
def ray_local(s3_endpoint):
    """An in-process local Ray that never joins a running cluster by accident. It starts after
    the S3 endpoint so that its worker processes inherit the AWS_* variables."""
    import ray

    from pipelines.common.ray_runtime import start_embedded

    start_embedded(num_cpus=2, object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1, with the AWS_* variables s3fs, pyarrow and Ray read."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture()
def s3_bucket(s3_endpoint) -> str:
    """A fresh bucket per test; returns its s3:// URI."""
    import s3fs

    name = f"kvrank-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(name)
    fs.invalidate_cache()
    return f"s3://{name}"


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A separate ``ray start --head`` cluster (as a platform team runs one) for job submission.

    Token auth is off for this local cluster (Ray 2.60 turns it on by default). The head runs
    with ``--block`` in its own process group, so stopping it kills exactly its processes and
    never another Ray on this machine (``ray stop`` would kill them all).
    """
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    dash = free_port()
    logfile = open(tmp_path_factory.mktemp("ray_head") / "head.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            os.path.join(bindir, "ray"),
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            "--num-cpus=1",
            "--disable-usage-stats",
            # its own agent ports, so an in-process Ray of the same test session (which takes
            # the default ports) cannot keep this head's job agent from starting
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ],
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"ray start --head did not come up; see {logfile.name}")
            time.sleep(1)
    # The dashboard answers before the node's job agent is up ("No available agent to submit
    # job"): wait until a trivial job has been accepted and has finished.
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    while True:
        try:
            job = client.submit_job(entrypoint="true")
            break
        except RuntimeError:
            if time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"the Ray head at {address} never accepted a job")
            time.sleep(1)
    while client.get_job_status(job) not in {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
    }:
        time.sleep(0.5)
    yield {"address": address, "env": env}
    # a throwaway cluster: `ray start --block` did not exit on SIGTERM within 30 s (it always
    # ran into the timeout), so its process group is killed outright; its workers exit with
    # their raylet
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    logfile.close()


@pytest.fixture(scope="session")
def tiny_trained(tmp_path_factory, ray_local):
    """The tiny dataset with a trained ranker, its CollectiveKV fine-tune and every user's
    state, built once per test run (``tests.tiny.tiny_chain``): tests only read it and write
    their own outputs under their own folders: {"dataset", "base", "fit", "states"} (the
    last three: the jobs' summaries)."""
    from tests.tiny import base_texts, prepare, tiny_chain, write_catalog, write_sequences

    d = tmp_path_factory.mktemp("tiny_trained")
    out = str(d / "out")
    ds = prepare(d, out, write_catalog(d, base_texts()), write_sequences(d))
    return {"dataset": ds, **tiny_chain(ds, out)}


@pytest.fixture()
def tiny(tmp_path):
    """A prepared tiny dataset: {"out", "dataset", "seq", "dir"}."""
    from tests.tiny import base_texts, prepare, write_catalog, write_sequences

    seq = write_sequences(tmp_path)
    items = write_catalog(tmp_path, base_texts())
    out = str(tmp_path / "out")
    return {"out": out, "dataset": prepare(tmp_path, out, items, seq), "seq": seq, "dir": tmp_path}
