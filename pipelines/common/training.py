"""What the Ray Train jobs (train_ranker, train_kv_pool, train_teacher) share: the training
options, the resume rule, the training rows in a new order every epoch, the TorchTrainer they
fit, and the worker side's restore, weight average and per-epoch report.

A run trains under ``<out>/<kind>/<run>/train/``, where Ray Train keeps its checkpoints (the
best few by the job's validation score, and the latest) and its record of them, from which a
resumed run continues; each checkpoint folder holds ``state.pt`` (whatever the loop needs to
continue, with every epoch's metrics so far) and ``metrics.json``. The best epoch is then
published beside ``train/`` by the job.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from artifacts import storage
from models.config import option
from models.errors import InputError

log = logging.getLogger("kvrank.training")


@dataclass(frozen=True)
class BaseTrainConfig:
    """How a training job runs: train_ranker's TrainConfig and train_teacher's
    TeacherTrainConfig add their losses' options (and their own defaults) to these."""

    epochs: int = option(30, "epochs at most (patience and max_minutes may stop sooner)")
    batch_size: int = option(32, "history windows per step per worker")
    lr: float = option(1e-3, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_len: int = option(50, "history items per training window; serving keeps this many")
    cuts: int = option(4, "predictions per window per step (one shared prefill)")
    negatives: int = option(31, "uniform sampled negatives per prediction")
    patience: int = option(4, "epochs without a better validation NDCG@10 before stopping")
    val_users: int = option(128, "users validated after every epoch")
    seed: int = option(0, "seed of the sampling, shuffling and initialisation")
    workers: int = option(1, "Ray Train workers (DDP)")
    use_gpu: bool = option(False, "one GPU per worker")
    max_failures: int = option(2, "worker failures survived by restarting from a checkpoint")
    max_minutes: float = option(
        0.0, "wall-clock cap of one attempt in minutes, checked after each epoch (0: none)"
    )
    max_steps: int = option(0, "optimizer steps per epoch and worker (0: the whole shard)")

    def __post_init__(self) -> None:
        for f in ("epochs", "batch_size", "max_len", "cuts", "negatives", "val_users", "workers"):
            if getattr(self, f) <= 0:
                raise InputError(f"--{f.replace('_', '-')} must be > 0, got {getattr(self, f)}")
        if self.max_minutes < 0:
            raise InputError(f"--max-minutes must be >= 0, got {self.max_minutes}")
        if self.max_steps < 0:
            raise InputError(f"--max-steps must be >= 0, got {self.max_steps}")


def open_file(folder: str, name: str) -> io.BytesIO:
    """A file of a (local or s3://) folder, read whole: torch.load takes it."""
    return io.BytesIO(storage.read_bytes(storage.join(folder, name)))


RUN_NAME = "run"  # Ray Train's run folder under <train_root>: one per training run
KEEP_CHECKPOINTS = 2  # the best epochs Ray Train keeps (by the score), besides the latest
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's checkpoints
# batches a worker reads at once when a trainer groups its rows into batches (by length)
BUCKET_BATCHES = 16


@dataclass(frozen=True)
class Trained:
    """What a training run left: its best checkpoint (folder URI and metrics), its latest one,
    and every epoch's metrics across all its attempts."""

    best: str
    best_metrics: dict
    latest: str
    history: list[dict]


def resume_check(train_root: str, run: str, resume: bool) -> None:
    """A fresh start under a run that has trained before would mix two trainings when the
    best epoch is picked: refused. ``--resume`` continues it: Ray Train finds the run's
    checkpoint snapshot under the same name and hands the loop its latest checkpoint."""
    started = storage.exists(storage.join(train_root, RUN_NAME, SNAPSHOT))
    if started and not resume:
        raise InputError(
            f"run {run!r} has already trained under {train_root}: pass --resume to continue "
            "it, or choose another --run"
        )
    if resume and not started:
        raise InputError(f"--resume: no checkpoint under {train_root}")


def attempts(train_root: str) -> int:
    """How many attempts (a first run and its resumes) the run has started."""
    path = storage.join(train_root, "attempts.json")
    return len(storage.read_json(path)) if storage.exists(path) else 0


def record_attempt(train_root: str) -> None:
    path = storage.join(train_root, "attempts.json")
    done = storage.read_json(path) if storage.exists(path) else []
    storage.write_bytes(path, json.dumps([*done, time.strftime("%Y-%m-%dT%H:%M:%S")]).encode())


def epoch_shuffled(table, seed: int, train_root: str):
    """A Ray dataset of ``table``'s rows in a new seeded order every epoch.

    Ray Data executes a Train dataset once per epoch; with ``reseed_after_execution`` its
    shuffle draws from (seed, execution index), so every epoch's batches differ and a rerun
    repeats them. Without it each epoch would replay one order, and a ``--max-steps`` cap
    would train every epoch on the same first windows. A resumed run folds its attempt number
    into the seed, so its epochs do not replay the first run's orders."""
    import numpy as np
    import ray
    from ray.data import RandomSeedConfig

    done = attempts(train_root)
    run_seed = int(np.random.SeedSequence([seed, done]).generate_state(1)[0])
    # the shuffle's tasks take a sliver of a CPU: the trainer's workers hold the rest, and a
    # whole-CPU task would wait for them forever
    ds = ray.data.from_arrow(table).random_shuffle(
        seed=RandomSeedConfig(seed=run_seed, reseed_after_execution=True), num_cpus=0.1
    )
    # the trainer's epoch lines are its progress: Ray Data's bars, redrawn at every epoch's
    # execution, would only mix their cursor codes into the job's log and its summary line
    ds.context.enable_progress_bars = False
    return ds


def fit(
    loop: Callable[[dict], None],
    config: dict,
    *,
    train_root: str,
    datasets: dict,
    workers: int,
    use_gpu: bool,
    max_failures: int,
    score: str,
) -> Trained:
    """Run ``loop`` on ``workers`` Ray Train workers under ``train_root`` and return what the
    run left. Ray Train tracks the checkpoints: it keeps the ``KEEP_CHECKPOINTS`` best by the
    reported ``score`` and the latest, restarts failed workers from the latest up to
    ``max_failures`` times, and (the run's name being fixed) continues a resumed run from it."""
    import ray
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    record_attempt(train_root)
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
        # one worker reads all the rows: unsplit, its iterator executes the dataset in the
        # worker itself, without the split coordinator that deals several workers their shards
        # (an actor: one more process and its imports before the first step)
        dataset_config=ray.train.DataConfig(datasets_to_split="all" if workers > 1 else []),
        run_config=ray.train.RunConfig(
            name=RUN_NAME,
            # Ray Train wants a URI or an absolute path; `--out out` is neither
            storage_path=train_root
            if storage.is_remote(train_root)
            else os.path.abspath(train_root),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=KEEP_CHECKPOINTS,
                checkpoint_score_attribute=score,
                checkpoint_score_order="max",
            ),
        ),
    )
    result = trainer.fit()
    if not result.best_checkpoints or result.checkpoint is None:
        raise RuntimeError(f"training produced no checkpoint under {train_root}")

    def uri(checkpoint) -> str:
        return f"s3://{checkpoint.path}" if storage.is_remote(train_root) else checkpoint.path

    best, best_metrics = max(result.best_checkpoints, key=lambda e: e[1][score])
    latest = uri(result.checkpoint)
    state = torch.load(open_file(latest, "state.pt"), map_location="cpu", weights_only=True)
    return Trained(uri(best), dict(best_metrics), latest, list(state["history"]))


# ----------------------------------------------------------------------------- worker side


def restored_state() -> dict | None:
    """The state a training loop continues from: Ray Train's latest checkpoint (after a
    worker restart, or in a resumed run); None for a fresh start."""
    import ray.train
    import torch

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), map_location="cpu", weights_only=True)


def progress(state: dict | None) -> tuple[int, float, int, list]:
    """(first epoch to run, best validation score, epochs without a better one, per-epoch
    metrics so far) of a restored state, or of a fresh start."""
    if state is None:
        return 0, -1.0, 0, []
    return state["epoch"] + 1, state["best"], state["bad"], state["history"]


def optimizer(model, tc: BaseTrainConfig):
    """AdamW over the weights that learn, as one fused kernel (on two cores the ranker's step
    takes 3.9 ms where the per-tensor loop took 6.8 ms; the same update)."""
    import torch

    learned = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(learned, lr=tc.lr, weight_decay=tc.weight_decay, fused=True)


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
    """Rank 0 saves ``state`` (state.pt, what ``restored_state`` reads back; with a
    ``history`` of every epoch's metrics), ``metrics`` (metrics.json) and ``files`` (name ->
    text) as the epoch's checkpoint; every worker reports the metrics, which Ray Train ranks
    the checkpoints by."""
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
    if "prior_weight" in metrics:  # a ranker trained complementary to the item prior
        parts.append(f"prior weight {metrics['prior_weight']:.1f}")
    seconds = f", {metrics['epoch_seconds']:.0f} s" if "epoch_seconds" in metrics else ""
    return f"{metrics['epoch']}: " + ", ".join(parts) + seconds


def convergence(history: list[dict], tc: BaseTrainConfig, score: str) -> dict:
    """Why a run stopped, read from its epochs' metrics: "patience" (``tc.patience`` epochs
    without a better ``score``: validation had stopped rising), "epochs" (``tc.epochs`` done) or
    "max_minutes" (the wall-clock cap); and whether its last epoch was its best, i.e. validation
    was still rising when it stopped and more epochs would likely have trained a better model."""
    best_at = max(range(len(history)), key=lambda i: history[i][score])  # the first best
    since = len(history) - 1 - best_at
    if since >= tc.patience:
        stopped = "patience"
    elif history[-1]["epoch"] + 1 >= tc.epochs:
        stopped = "epochs"
    else:
        stopped = "max_minutes"
    return {"stopped_by": stopped, "val_still_rising": since == 0}


def out_of_time(started: float, max_minutes: float, world: int) -> bool:
    """Worker side: whether the wall-clock cap has passed, agreed by all workers (the max), so
    every worker stops after the same epoch."""
    import torch

    flag = torch.tensor(float(max_minutes > 0 and time.perf_counter() - started > 60 * max_minutes))
    if world > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def unwrap(model):
    """The model inside a DDP wrapper (itself when not wrapped)."""
    return model.module if hasattr(model, "module") else model


def train_epochs(
    model,
    opt,
    tc: BaseTrainConfig,
    *,
    rank: int,
    world: int,
    state: dict | None,
    step: Callable[[Any, Any], tuple[Any, dict[str, float]]],
    validate: Callable[[Any], dict[str, float]],
    score: str,
    batches: Callable[[dict, Any], Iterable[Any]] | None = None,
    average=None,
    train_mode: bool = True,
    log_every: int = 200,
    files: dict[str, str] | None = None,
    first_metrics: dict | None = None,
) -> None:
    """The one epoch loop every trainer runs (worker side), from ``state`` (a restored
    checkpoint, or None) to the last epoch:

    - each epoch reads this worker's shard of the training rows in a seeded local shuffle;
      with ``batches``, in chunks of ``BUCKET_BATCHES`` batches that ``batches(rows, rng)`` cuts
      into the step's batches (the ranker's: windows of similar lengths); ``step(batch, rng)``
      returns the loss to minimise and the named terms to report (their
      epoch means; ``"loss"``, the labels' loss, is averaged over every worker), and the
      optimizer steps on it with the gradient norm clipped at 1 (``--max-steps`` caps the
      steps); ``average`` (an EMA of the weights, or None) follows every step;
    - ``validate(model)`` scores the average (or the weights) and returns the epoch's
      validation figures, ``score`` among them (summed over workers by the callee);
    - rank 0 reports the epoch's checkpoint (weights, their average, optimizer, progress, every
      epoch's metrics; ``files`` beside them) to Ray Train, which ranks checkpoints by
      ``score``; training stops after ``--patience`` epochs without a better ``score`` or when
      ``--max-minutes`` have passed.
    """
    import ray.train
    import torch

    start_epoch, best, bad, history = progress(state)
    shard = ray.train.get_dataset_shard("train")
    started = time.perf_counter()
    for epoch in range(start_epoch, tc.epochs):
        t0 = time.perf_counter()
        model.train(train_mode)
        rng = np.random.default_rng([tc.seed, epoch, rank])
        terms: dict[str, list[float]] = {}
        steps = 0
        chunk = tc.batch_size * (BUCKET_BATCHES if batches is not None else 1)
        for rows in shard.iter_batches(
            batch_size=chunk,
            batch_format="numpy",
            local_shuffle_buffer_size=max(4 * tc.batch_size, chunk),
            local_shuffle_seed=tc.seed + epoch,
        ):
            for batch in batches(rows, rng) if batches is not None else [rows]:
                loss, parts = step(batch, rng)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if average is not None:
                    average.update_parameters(unwrap(model))
                for name, value in parts.items():
                    terms.setdefault(name, []).append(value)
                steps += 1
                if rank == 0 and steps % log_every == 0:  # progress within long epochs
                    loss_now = float(np.mean(terms["loss"]))
                    log.info("epoch %d step %d loss %.4f", epoch, steps, loss_now)
                if steps == tc.max_steps:  # every worker stops at the same count (DDP paired)
                    break
            if steps == tc.max_steps:
                break
        train_seconds = time.perf_counter() - t0
        figures = validate(model if average is None else average.module)
        losses = terms.pop("loss", [])
        loss_sum, loss_n = all_sum([sum(losses), len(losses)], world)
        best, bad = (figures[score], 0) if figures[score] > best else (best, bad + 1)
        metrics = {
            "epoch": epoch,
            "loss": loss_sum / max(loss_n, 1),
            **{name: float(np.mean(values)) for name, values in terms.items()},
            **figures,
            f"best_{score}": best,
            "steps": steps,
            "train_seconds": train_seconds,
            "epoch_seconds": time.perf_counter() - t0,
        }
        if first_metrics and epoch == 0:
            metrics |= first_metrics
        history.append(metrics)
        state = {
            "model": unwrap(model).state_dict(),
            # what is validated and published when there is an average (else: "model")
            "published": None if average is None else average.module.state_dict(),
            "averaged_steps": 0 if average is None else int(average.n_averaged),
            "optimizer": opt.state_dict(),
            "epoch": epoch,
            "best": best,
            "bad": bad,
            "history": history,
        }
        report_epoch(rank, state, metrics, files)
        if bad >= tc.patience or out_of_time(started, tc.max_minutes, world):
            break
