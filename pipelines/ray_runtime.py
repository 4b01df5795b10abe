"""How a job gets its Ray: the cluster it was submitted to, or an embedded local one.

``ray job submit`` sets RAY_ADDRESS for the driver, so ``ray.init()`` joins that cluster. Run
directly (``python -m pipelines.<job>``) with no RAY_ADDRESS, a local Ray starts in-process with
this machine's CPUs and a modest object store - the embedded default for laptops and CI. A Ray
already initialised by the caller (a test, a notebook) is used as it is.
"""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger("kvrank.ray")

LOCAL_OBJECT_STORE = 512 * 1024 * 1024


def init_ray() -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("joined the Ray cluster at %s", address)
        return
    ray.init(
        address="local",
        include_dashboard=False,
        object_store_memory=LOCAL_OBJECT_STORE,
        log_to_driver=True,
    )
    log.info("started an embedded local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def cpus_per_actor(actors: int) -> float:
    """CPUs for each of ``actors`` actors sharing the cluster: an equal share of all CPUs, but
    never more than the largest node has (an actor lives on one node; asking for more than any
    node holds would leave it pending forever on a cluster of small nodes)."""
    total = ray.cluster_resources().get("CPU", 1)
    largest = max(
        (n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]),
        default=total,
    )
    return min(total / actors, largest) or 1
