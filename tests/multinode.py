"""A three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and two
workers, one CPU each, every node its own raylet and object store), and the jobs and the Serve
app run on it. Run as a script by tests/test_multinode.py, in its own process so that it never
meets the test session's local Ray; prints one JSON line of what ran where.

    python -m tests.multinode OUT_DIR

Placement is forced by resources, not left to luck: 2 encoder actors and 2 Ranker replicas of
0.75 CPU each cannot share a one-CPU node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def nodes_of(dashboard: str, class_part: str) -> set[str]:
    """Nodes that ran actors whose class name contains ``class_part`` (alive or finished)."""
    from ray.util.state import list_actors

    found = list_actors(address=dashboard, detail=True, limit=10_000, raise_on_missing_output=False)
    return {a.node_id for a in found if class_part in (a.class_name or "")}


def main(out_dir: str) -> dict:
    import httpx
    import ray
    import ray.data
    from ray import serve
    from ray.cluster_utils import Cluster

    from pipelines import encode_items
    from services.app import build_app
    from tests.conftest import free_port
    from tests.tiny import base_texts, prepare, tiny_chain, write_catalog, write_sequences

    d = Path(out_dir)
    out = str(d / "out")
    ds = prepare(d, out, write_catalog(d, base_texts()), write_sequences(d))
    dash = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,  # the state API that says where actors ran
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dash,
            "object_store_memory": 128 * 1024**2,
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=128 * 1024**2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        # 60 items in batches of 8: 8 blocks for 2 actors that cannot share a 1-CPU node
        argv = ["--dataset-uri", ds, "--out", out, "--actors", "2", "--batch-size", "8"]
        argv += ["--cpus-per-actor", "0.75"]
        # Ray Data starts a pool's actors asynchronously and hands blocks to the first one ready:
        # on a loaded machine it finished all 8 before the second had started on its node (seen in
        # CI). Waiting for the whole pool makes the placement the test checks certain.
        ray.data.DataContext.get_current().wait_for_min_actors_s = 300
        assert encode_items.main(argv) == 0
        encoder_nodes = nodes_of(f"http://127.0.0.1:{dash}", "EncoderActor")

        built = tiny_chain(ds, out, actors=2)["states"]

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        app = build_app(
            {
                "manifest_uri": built["user_states"],
                "ranker_min_replicas": 2,
                "ranker_max_replicas": 2,
                "ranker_num_cpus": 0.75,
            }
        )
        serve.run(app, name="kvrank", route_prefix="/")
        statuses = []
        with httpx.Client(timeout=60) as client:
            for user in range(40):
                r = client.post(
                    f"http://127.0.0.1:{port}/v1/rank",
                    json={"user_id": user, "candidate_item_ids": [1, 2, 3, 4, 5], "k": 3},
                )
                statuses.append(r.status_code)
        ranker_nodes = nodes_of(f"http://127.0.0.1:{dash}", "Ranker")
        serve.shutdown()
        return {
            "nodes": len(nodes),
            "encoder_nodes": len(encoder_nodes & set(nodes)),
            "ranker_nodes": len(ranker_nodes & set(nodes)),
            "rank_statuses": sorted(set(statuses)),
            "requests": len(statuses),
            "users_with_state": built["users"],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
