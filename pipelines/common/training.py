"""What the Ray Train jobs (train_ranker, train_kv_pool, train_teacher) share on the driver side:
a run's checkpoint history across attempts, the resume rule, the training rows in a new order
every epoch, and the TorchTrainer they fit.

A run keeps every attempt's checkpoints under ``<out>/<kind>/<run>/train/attempt-*/``; each
checkpoint folder holds ``state.pt`` (whatever the loop needs to continue) and ``metrics.json``
(with at least ``epoch``). The best epoch is then published beside ``train/`` by the job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from artifacts import storage
from artifacts.errors import InputError

log = logging.getLogger("kvrank.training")

C = TypeVar("C")


@dataclass(frozen=True)
class BaseTrainConfig:
    """How a training job runs: train_ranker's TrainConfig and train_teacher's
    TeacherTrainConfig add their losses' options (and their own defaults) to these."""

    epochs: int = 30
    batch_size: int = 32  # history windows per step per worker
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_len: int = 50  # history items per training window; serving reads this many
    cuts: int = 4  # predictions per window per step (one shared prefill in the ranker)
    negatives: int = 31  # sampled negatives per prediction
    patience: int = 4  # epochs without a better validation NDCG@10 before stopping
    val_users: int = 128  # users in the validation
    seed: int = 0
    workers: int = 1
    use_gpu: bool = False
    max_failures: int = 2  # worker failures survived by restarting from the last checkpoint
    # wall-clock cap of one attempt, in minutes (0: none): training stops after the epoch that
    # crosses it, like the capped reference runs the quality targets are set against
    max_minutes: float = 0.0
    # optimizer steps per epoch and worker (0: the whole shard): a short fine-tune on a large
    # dataset, e.g. each configuration of the CollectiveKV sweep on amazon-videogames-2018
    max_steps: int = 0

    def __post_init__(self) -> None:
        for f in ("epochs", "batch_size", "max_len", "cuts", "negatives", "val_users", "workers"):
            if getattr(self, f) <= 0:
                raise InputError(f"--{f.replace('_', '-')} must be > 0, got {getattr(self, f)}")
        if self.max_minutes < 0:
            raise InputError(f"--max-minutes must be >= 0, got {self.max_minutes}")
        if self.max_steps < 0:
            raise InputError(f"--max-steps must be >= 0, got {self.max_steps}")


def add_config_args(p: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One option per field of the dataclass ``cls`` (--epochs, --lr, ...); booleans are flags
    that turn a False default on."""
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            g.add_argument(flag, action="store_true", default=f.default)
        else:
            g.add_argument(flag, type=type(f.default), default=f.default)


def config_from_args(a: argparse.Namespace, cls: type[C]) -> C:
    values: dict[str, Any] = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls)}
    return cls(**values)


def open_file(folder: str, name: str) -> io.BytesIO:
    """A file of a (local or s3://) folder, read whole: torch.load takes it."""
    return io.BytesIO(storage.read_bytes(storage.join(folder, name)))


def list_checkpoints(train_root: str) -> list[tuple[str, dict]]:
    """(folder, metrics) of every checkpoint under ``train_root`` (all attempts), by epoch."""
    fs, path = storage.filesystem(train_root)
    try:
        found = fs.glob(f"{path.rstrip('/')}/*/checkpoint_*/metrics.json")
    except FileNotFoundError:
        return []
    prefix = "s3://" if train_root.startswith("s3://") else ""
    folders = [prefix + f.rsplit("/", 1)[0] for f in found]
    entries = [(f, storage.read_json(storage.join(f, "metrics.json"))) for f in folders]
    return sorted(entries, key=lambda e: e[1]["epoch"])


def resume_point(train_root: str, run: str, resume: bool) -> str | None:
    """The checkpoint folder to continue from (``resume``), or None for a fresh run.

    Every attempt under a run continues the one before it, so the run's checkpoints form one
    history; a second fresh start would mix two trainings when the best epoch is picked."""
    previous = list_checkpoints(train_root)
    if previous and not resume:
        raise InputError(
            f"run {run!r} already has {len(previous)} checkpoint(s) under {train_root}: "
            "pass --resume to continue it, or choose another --run"
        )
    if resume and not previous:
        raise InputError(f"--resume: no checkpoint under {train_root}")
    if resume:
        log.info("resuming from %s", previous[-1][0])
        return previous[-1][0]
    return None


def epoch_shuffled(table, seed: int, train_root: str):
    """A Ray dataset of ``table``'s rows in a new seeded order every epoch.

    Ray Data executes a Train dataset once per epoch; with ``reseed_after_execution`` its
    shuffle draws from (seed, execution index), so every epoch's batches differ and a rerun
    repeats them. Without it each epoch would replay one order, and a ``--max-steps`` cap
    would train every epoch on the same first windows. A resumed run folds the epochs it
    already has into the seed, so its epochs do not replay the first run's orders."""
    import numpy as np
    import ray
    from ray.data import RandomSeedConfig

    done = len(list_checkpoints(train_root))
    run_seed = int(np.random.SeedSequence([seed, done]).generate_state(1)[0])
    # the shuffle's tasks take a sliver of a CPU: the trainer's workers hold the rest, and a
    # whole-CPU task would wait for them forever
    return ray.data.from_arrow(table).random_shuffle(
        seed=RandomSeedConfig(seed=run_seed, reseed_after_execution=True), num_cpus=0.1
    )


def fit(
    loop: Callable[[dict], None],
    config: dict,
    *,
    train_root: str,
    datasets: dict,
    workers: int,
    use_gpu: bool,
    max_failures: int,
) -> list[tuple[str, dict]]:
    """Run ``loop`` on ``workers`` Ray Train workers (a new attempt under ``train_root``) and
    return the run's checkpoints, all attempts. Failed workers restart from the latest
    checkpoint up to ``max_failures`` times."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    cpus = int(ray.cluster_resources().get("CPU", 1))
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": min(1, cpus / (workers + 1))},
        ),
        datasets=datasets,
        run_config=ray.train.RunConfig(
            name=f"attempt-{time.strftime('%Y%m%d-%H%M%S')}",
            # Ray Train wants a URI or an absolute path; `--out out` is neither
            storage_path=train_root
            if storage.is_remote(train_root)
            else os.path.abspath(train_root),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
        ),
    )
    trainer.fit()
    checkpoints = list_checkpoints(train_root)
    if not checkpoints:
        raise RuntimeError(f"training produced no checkpoint under {train_root}")
    return checkpoints


# ----------------------------------------------------------------------------- worker side


def restored_state(config: dict) -> dict | None:
    """The state a training loop continues from: Ray Train's latest checkpoint after a worker
    restart, else the run's resume point (``config["resume_from"]``); None for a fresh start."""
    import ray.train
    import torch

    ckpt = ray.train.get_checkpoint()
    source = ckpt.path if ckpt else config.get("resume_from")
    if not source:
        return None
    with ckpt.as_directory() if ckpt else contextlib.nullcontext(source) as d:
        return torch.load(open_file(d, "state.pt"), map_location="cpu", weights_only=True)


def progress(state: dict | None) -> tuple[int, float, int, list]:
    """(first epoch to run, best validation score, epochs without a better one, per-epoch
    metrics so far) of a restored state, or of a fresh start."""
    if state is None:
        return 0, -1.0, 0, []
    return state["epoch"] + 1, state["best"], state["bad"], state["history"]


def weight_average(model, decay: float, state: dict | None):
    """An exponential moving average of ``model``'s parameters (``torch.optim.swa_utils.
    AveragedModel``: ``update_parameters(model)`` after each optimizer step, ``.module`` to
    score with); None when ``decay`` is 0. It starts as a copy of the weights and moves
    ``1 - decay`` of the way to the current ones every step, so it averages roughly the last
    1 / (1 - decay) steps. A checkpoint keeps it as ``state["published"]`` (its weights) and
    ``state["averaged_steps"]``, from which a continued run restores it."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    if not decay:
        return None
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    if state is not None and state.get("averaged_steps"):
        average.module.load_state_dict(state["published"])
        average.n_averaged.fill_(int(state["averaged_steps"]))
    return average


def all_sum(values: list[float], world: int) -> list[float]:
    """The sums of ``values`` over all workers."""
    import torch

    totals = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        torch.distributed.all_reduce(totals)
    return totals.tolist()


def report_epoch(rank: int, state: dict, metrics: dict, files: dict[str, str] | None = None):
    """Rank 0 saves ``state`` (state.pt, what ``restored_state`` reads back), ``metrics``
    (metrics.json, what ``list_checkpoints`` reads) and ``files`` (name -> text) as the epoch's
    checkpoint; every worker reports the metrics."""
    import ray.train
    import torch

    if rank == 0:  # the epoch's line in the job's log: its validation is otherwise only on disk
        log.info("epoch %s", epoch_line(metrics))
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            torch.save(state, os.path.join(d, "state.pt"))
            for name, text in {"metrics.json": json.dumps(metrics), **(files or {})}.items():
                with open(os.path.join(d, name), "w") as f:
                    f.write(text)
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def epoch_line(metrics: dict) -> str:
    """One epoch's figures as a log line: ``3: loss 9.5561, val_ndcg10 0.0566 (best 0.0566),
    429 s`` (the validation keys are each trainer's own)."""
    val = [k for k in metrics if k.startswith("val_") and k.endswith("ndcg10")]
    parts = [f"loss {metrics['loss']:.4f}"] + [
        f"{k} {metrics[k]:.4f}"
        + (f" (best {metrics['best_' + k]:.4f})" if "best_" + k in metrics else "")
        for k in val
    ]
    seconds = f", {metrics['epoch_seconds']:.0f} s" if "epoch_seconds" in metrics else ""
    return f"{metrics['epoch']}: " + ", ".join(parts) + seconds


def out_of_time(started: float, max_minutes: float, world: int) -> bool:
    """Worker side: whether the wall-clock cap has passed, agreed by all workers (the max), so
    every worker stops after the same epoch."""
    import torch

    flag = torch.tensor(float(max_minutes > 0 and time.perf_counter() - started > 60 * max_minutes))
    if world > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
