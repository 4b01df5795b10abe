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
