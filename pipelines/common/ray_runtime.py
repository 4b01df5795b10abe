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
# Ray Train's controller polls its workers every 2 s by default, so a run ends up to 2 s after
# its last epoch and each start waits on the same poll: on one machine a poll is a local RPC, and
# a quarter second took ~3 s off every training run (a one-epoch tiny run: 14.5 s -> 12.4 s)
EMBEDDED_TRAIN_POLL_S = "0.25"
# Ray Train starts a preemption watcher (one more actor process, its imports ~2-3 CPU-seconds)
# for every worker group, to notice nodes a cloud takes back; an embedded Ray is one machine
# that no one preempts, so it runs without one (a cluster keeps Ray's default)
EMBEDDED_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": EMBEDDED_TRAIN_POLL_S,
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
EMBEDDED_SETUP_HOOK = "pipelines.common.ray_runtime.embedded_worker_setup"  # run in each worker
# Idle worker processes the embedded Ray keeps for reuse. Ray's default is one per CPU, so on a
# small machine the idle workers left by one stage (a Ray Data map, a training run) are killed
# a second later and the next stage starts new ones, each paying Python, Ray and torch imports
# (~2-3 CPU-seconds here). Keeping eight: the tiny train -> pool fit -> states chain on this
# 2-core machine 71.6/64.8/72.3 s -> 59.3/58.7 s, 31 worker processes -> 25.
EMBEDDED_IDLE_WORKERS = 8


def init_ray() -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("joined the Ray cluster at %s", address)
        return
    start_embedded()
    log.info("started an embedded local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))


def start_embedded(
    num_cpus: int | None = None,
    object_store_memory: int = LOCAL_OBJECT_STORE,
    log_to_driver: bool = True,
) -> None:
    """Start an in-process local Ray that never joins a running cluster by accident: no
    dashboard, a modest object store, ``embedded_worker_setup`` in every worker, idle workers
    kept for the next stage (``EMBEDDED_IDLE_WORKERS``), and Ray Train's controller polling its
    workers at ``EMBEDDED_TRAIN_POLL_S`` with no preemption watcher (``EMBEDDED_TRAIN_ENV``,
    unless set already)."""
    # read by the driver at each fit and passed on to the controller and the workers
    for name, value in EMBEDDED_TRAIN_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_memory,
        log_to_driver=log_to_driver,
        runtime_env={"worker_process_setup_hook": EMBEDDED_SETUP_HOOK},
        _system_config={"num_workers_soft_limit": EMBEDDED_IDLE_WORKERS},
    )


def embedded_worker_setup() -> None:
    """Runs in every worker process of the embedded Ray.

    - It points ``RAY_ADDRESS`` at this Ray's own GCS. Ray Train's placement-group cleaner (an
      actor) looks its cluster up through the State API with no address, which then falls back
      to the cluster named in ``/tmp/ray`` by the last ``ray start`` - an embedded Ray never
      writes it. With a stale or second cluster on the machine the lookup hung, and every
      training run waited 12 s for the cleaner to give up after its last epoch.
    - Without a dashboard there is no State API, and the same cleaner (a safety net for a dead
      controller, which an in-process Ray takes down with the driver anyway) warns that it
      cannot reach it every second of a training run; those lines would bury the job's own
      progress.
    """
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    logging.getLogger(
        "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    ).setLevel(logging.ERROR)


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
