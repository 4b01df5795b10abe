"""Ray Data actor pools that hold a trained model: the shared part of evaluate,
build_user_states, the K/V collection of train_kv_pool / analyze_kv, and label_teacher."""

from __future__ import annotations

import pyarrow as pa

from artifacts.data import blocks


class RankerActor:
    """Base of the callable classes: each actor loads the ranker (and its item table) once."""

    def __init__(self, checkpoint: str, vectors_uri: str | None, threads: int) -> None:
        import torch

        from artifacts.data import load_ranker

        torch.set_num_threads(max(1, threads))
        self.model, self.marker, self.max_len = load_ranker(checkpoint, vectors_uri)


def map_with_rankers(
    table: pa.Table,
    actor_cls: type[RankerActor],
    checkpoint: str,
    vectors_uri: str | None,
    *,
    actors: int,
    batch_size: int,
    extra_args: tuple = (),
):
    """``table`` mapped in numpy batches by a pool of ``actors`` ``actor_cls`` actors, each
    holding the ranker of ``checkpoint``."""
    return map_with_pool(
        table,
        actor_cls,
        lambda threads: (checkpoint, vectors_uri, threads, *extra_args),
        actors=actors,
        batch_size=batch_size,
    )


def pool_size(rows: int, batch_size: int, actors: int) -> int:
    """The actors a pool of up to ``actors`` starts for ``rows`` rows in batches of
    ``batch_size``: no more than there are batches, since an actor that gets none still starts
    a process and loads its model."""
    return max(1, min(actors, -(-rows // max(1, batch_size))))


def map_with_pool(
    table: pa.Table,
    actor_cls: type,
    args,
    *,
    actors: int,
    batch_size: int,
    gpu: bool = False,
    batch_format: str = "numpy",
):
    """``table`` mapped in batches (numpy, or ``batch_format``) by a pool of ``actors``
    ``actor_cls`` actors (``pool_size``: no more than the table makes batches) sharing the
    cluster's CPUs (``ray_runtime.cpus_per_actor``), or with one GPU each (``gpu``), built with
    ``args(threads)``; the table is pre-cut into blocks (see ``data.blocks``)."""
    import ray

    from pipelines.common.ray_runtime import cpus_per_actor, init_ray

    init_ray()
    actors = pool_size(table.num_rows, batch_size, actors)
    cpus = 1.0 if gpu else cpus_per_actor(actors)
    ds = ray.data.from_arrow(blocks(table, actors * 4))
    return ds.map_batches(
        actor_cls,
        fn_constructor_args=args(max(1, int(cpus))),
        compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=batch_size,
        batch_format=batch_format,
        num_cpus=cpus,
        num_gpus=1 if gpu else 0,
    )
