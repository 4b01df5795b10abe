"""Scale on one machine: a three-node Ray cluster (tests/multinode.py) runs the encode job, the
ranker and CollectiveKV jobs and the Serve app, with work placed on more than one node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_jobs_and_serve_run_across_three_nodes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.multinode", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["nodes"] == 3
    assert got["encoder_nodes"] == 2  # 2 actors x 0.75 CPU: one per node
    assert got["ranker_nodes"] == 2  # 2 replicas x 0.75 CPU: one per node
    assert got["rank_statuses"] == [200] and got["requests"] == 40
    assert got["users_with_state"] == 40
