"""A three-node Ray cluster on this machine, for the tests that run the jobs and the Serve app as
an operator does (tests/test_ray_job.py): ``ray.cluster_utils.Cluster``, a head and two workers
of one CPU each, every node its own raylet and object store. The head has the dashboard (the
Jobs API ``ray job submit`` talks to, the Serve REST API ``serve deploy`` talks to, and the
State API that says where actors ran) on 127.0.0.1.

    python -m tests.cluster          # prints {"address": ..., "gcs": ...}, runs until stdin closes

It runs in its own process (and process group, which the tests kill when done), so that it
never meets the test session's embedded Ray.
"""

from __future__ import annotations

import json
import sys

from tests.conftest import free_port

NODES = 3
OBJECT_STORE = 128 * 1024**2


def main() -> None:
    from ray.cluster_utils import Cluster

    from pipelines.common.ray_runtime import EMBEDDED_IDLE_WORKERS

    dash = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dash,
            "object_store_memory": OBJECT_STORE,
            # its own agent ports: the test session's embedded Ray takes the default ones, and
            # the head's job agent would then never start ("No available agent to submit job")
            "dashboard_agent_listen_port": free_port(),
            "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port(),
            "ray_client_server_port": free_port(),
            # idle workers kept for the next job, as on the embedded Ray (one CPU a node would
            # keep one)
            "_system_config": {"num_workers_soft_limit": EMBEDDED_IDLE_WORKERS},
        },
    )
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    print(json.dumps({"address": f"http://127.0.0.1:{dash}", "gcs": cluster.address}), flush=True)
    try:
        sys.stdin.read()  # the test closes it (or kills the process group)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
