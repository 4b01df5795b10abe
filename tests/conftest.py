"""Shared fixtures: the data directory, a local Ray, an S3 endpoint (moto) and a redis-server
on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from benchmarks.redis_server import RedisCluster, RedisServer, free_port
from pipelines.common import sources

# the slow tier: every test that starts a Ray (embedded or a cluster) or needs the tiny trained
# chain; `make test-fast` runs the rest (`-m "not slow"`)
RAY_FIXTURES = {"ray_local", "ray_cluster", "tiny_trained"}


# `make test` runs the vLLM tests in .venv-vllm from this one file alone
VLLM_TESTS = "test_vllm.py"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("vllm") and item.path.name != VLLM_TESTS:
            raise pytest.UsageError(
                f"{item.nodeid}: vLLM tests belong in tests/{VLLM_TESTS} (make test runs only it "
                "in .venv-vllm)"
            )


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray and ray.is_initialized())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test outside the slow tier that starts a Ray (a job run in-process starts an embedded
    one) fails, naming the fixture that puts it in the slow tier: `make test-fast` stays free of
    Ray."""
    before = _ray_running()
    result = yield
    if not before and _ray_running() and not item.get_closest_marker("slow"):
        pytest.fail(
            f"{item.nodeid} started a Ray outside the slow tier: give it the ray_local fixture",
            pytrace=False,
        )
    return result


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real three-master Redis Cluster on 127.0.0.1."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.kill()


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
def store_uri(request, tmp_path) -> str:
    """A fresh store of each engine: a local folder, or a fresh key prefix on the Redis server
    or on the Redis Cluster."""
    if request.param == "sqlite":
        return str(tmp_path / "store")
    server = {"redis": "redis_server", "redis-cluster": "redis_cluster"}[request.param]
    return request.getfixturevalue(server).uri()


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
def ray_cluster():
    """A three-node Ray cluster on this machine (``tests.cluster``), as a platform team runs one:
    jobs go to it with ``ray job submit``, the app with ``serve deploy``. {"address": the
    dashboard's URL, "env": the environment its commands run with}.

    Ray's token authentication is on (RAY_AUTH_MODE=token) with a fresh token, which "env"
    carries to the operators' commands (``ray job submit``, ``serve deploy``) and "headers" to
    HTTP calls of the dashboard's APIs; nothing reaches it without the token. The cluster
    runs in its own process group, so stopping it kills exactly its processes and never another
    Ray on this machine (``ray stop`` would kill them all); its workers exit with their raylets.
    """
    import json
    import secrets
    import signal
    import subprocess
    import sys
    import time

    from pipelines.common import ray_runtime

    bindir = os.path.dirname(sys.executable)
    token = secrets.token_hex(32)
    headers = {"Authorization": f"Bearer {token}"}
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        PATH=f"{bindir}:{os.environ.get('PATH', '')}",
        # Ray Train's controller polls as on the embedded Ray (ray_runtime.EMBEDDED_TRAIN_POLL_S)
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=ray_runtime.EMBEDDED_TRAIN_POLL_S,
        # an actor pool starts its actors asynchronously and hands blocks to the first one ready:
        # on a loaded machine one actor did all the work before the other had a node (seen in
        # CI). Waiting for the whole pool makes the placement the tests check certain.
        RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S="300",
    )
    env.pop("RAY_ADDRESS", None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster"],
        cwd=repo,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("the three-node Ray cluster did not start (python -m tests.cluster)")
        address = json.loads(line)["address"]
        # The dashboard answers before the head's job agent is up ("No available agent to
        # submit job"): wait until a trivial job has been accepted and has finished.
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(address, headers=headers)
        deadline = time.time() + 120
        while True:
            try:
                job = client.submit_job(entrypoint="true")
                break
            except RuntimeError:
                if time.time() > deadline:
                    pytest.fail(f"the Ray head at {address} never accepted a job")
                time.sleep(0.5)
        while not client.get_job_status(job).is_terminal():
            time.sleep(0.2)
        yield {"address": address, "env": env, "headers": headers}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


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
