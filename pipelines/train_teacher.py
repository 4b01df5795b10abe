"""Train the full-text teacher (models.teacher) with Ray Train, on the ranker's examples.

    python -m pipelines.train_teacher --dataset-uri out/datasets/ml-latest-small --out out \\
        [--run NAME] [--kind causal|cross] [--workers 1] [--epochs 4] [--cuts 1]
        [--negatives 7] [--resume] [--lr (by kind)] [--max-length (by kind)]
        [--d-model 128] [--n-layers 2] [--max-history 20] [--random-init]

Two kinds of teacher (``models.teacher``): ``causal`` (the default), a small Llama trained from
scratch whose score is a "yes" logit - the form vLLM serves with prefix caching, the serving
baseline; and ``cross``, a cross-encoder fine-tuned from the shipped, pretrained MiniLM over
(candidate, history) pairs - the stronger labeller on a CPU (default run name
``<dataset>-cross-teacher``, lr 5e-5, 128 tokens; the causal kind's are 5e-4 and 256).

The examples are the ranker's (``models.batches``): every user's history in windows of
``--max-len`` + 1 items, per window ``--cuts`` cut points, the next item as the positive and
``--negatives`` uniform negatives. Each candidate is one prompt - the history titles with their
feedback and the candidate's title (``models.teacher.build_prompt`` / ``cross_pair``) - and the
logits of one cut's candidates meet a softmax cross-entropy with the positive first: the
ranker's listwise loss, so the teacher's scores over a candidate set are a distribution the
ranker can be distilled towards (``pipelines.label_teacher``, ``train_ranker --teacher-labels``).

After each epoch the workers compute sampled validation NDCG@10 for ``--val-users`` users: the
validation item among that user's 100 sampled negatives (a full-catalog ranking would be one
prompt per catalog item and user). Checkpoints, ``--resume``, restarts of failed workers and the
``--max-minutes`` cap work as in train_ranker. The best epoch is published to
``<out>/teachers/<run>/``: a Hugging Face directory (config, weights, tokenizer) that
``TeacherConfig(model_dir=...)`` (and, for the causal kind, vLLM) load, plus ``teacher.json``
(the kind and prompt settings), ``metrics.json`` and ``_SUCCESS.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from artifacts import storage
from artifacts.data import item_titles, training_windows, user_sequences
from artifacts.errors import InputError
from models.config import TEACHER_KINDS, TeacherConfig
from models.metrics import summarize
from pipelines.common import jobs
from pipelines.common.teachers import sampled_ranks
from pipelines.common.training import (
    BaseTrainConfig,
    add_config_args,
    all_sum,
    config_from_args,
    epoch_shuffled,
    fit,
    open_file,
    out_of_time,
    progress,
    report_epoch,
    restored_state,
    resume_point,
)
from pipelines.common.validation import sample_val

log = logging.getLogger("kvrank.train_teacher")


@dataclass(frozen=True)
class TeacherTrainConfig(BaseTrainConfig):
    """How to train the teacher (the shared options, the teacher's defaults); its shape and
    prompt are the TeacherConfig beside it."""

    epochs: int = 4
    batch_size: int = 8  # windows per step per worker; prompts = batch * cuts * (1 + negatives)
    lr: float = 5e-4
    cuts: int = 1
    negatives: int = 7  # uniform
    patience: int = 2
    val_users: int = 64  # users in the sampled validation (101 prompts each)


# what each kind starts from: the causal LM trains from scratch (a higher rate; at its width long
# prompts are cheap), the cross-encoder fine-tunes pretrained MiniLM (a BERT fine-tuning rate;
# every prompt is a 6-layer, 384-wide forward, so prompts are kept shorter)
KIND_DEFAULTS = {
    "causal": {"lr": 5e-4, "max_length": 256},
    "cross": {"lr": 5e-5, "max_length": 128},
}


def teacher_uri(out: str, run: str) -> str:
    return storage.join(out, "teachers", run)


# ----------------------------------------------------------------------------- worker side


def train_loop(config: dict) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import ray.train.torch

    from models.batches import sample_candidates, sample_window
    from models.teacher import build_teacher, examples_for

    jobs.setup_logging()  # the step progress lines below, from this worker process
    tc = TeacherTrainConfig(**config["train"])
    mc = TeacherConfig.from_dict(config["teacher"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["threads"])
    torch.manual_seed(tc.seed)
    teacher = build_teacher(mc)
    titles = item_titles(config["dataset_uri"])
    state = restored_state(config)
    start_epoch, best, bad, history = progress(state)
    if state is not None:
        teacher.load_state_dict(state["model"])
    model = ray.train.torch.prepare_model(teacher)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    val = config["val"]
    mine = list(range(rank, len(val["valid"]), world))
    shard = ray.train.get_dataset_shard("train")
    started = time.perf_counter()
    for epoch in range(start_epoch, tc.epochs):
        t0 = time.perf_counter()
        model.train()
        rng = np.random.default_rng([tc.seed, epoch, rank])
        losses, steps = [], 0
        for batch in shard.iter_batches(
            batch_size=tc.batch_size,
            batch_format="numpy",
            local_shuffle_buffer_size=4 * tc.batch_size,
            local_shuffle_seed=tc.seed + epoch,
        ):
            examples = []
            for v, f in zip(batch["hist"], batch["hist_fb"], strict=True):
                wv, wf = sample_window(v, f, rng, tc.max_len)
                t, cands = sample_candidates(
                    wv, rng, n_items=len(titles), cuts=tc.cuts, negatives=tc.negatives
                )
                examples += examples_for(wv, wf, t, cands, titles)
            logits = model(teacher.tokenize(teacher.prompts(examples)))
            logits = logits.view(-1, 1 + tc.negatives)
            loss = torch.nn.functional.cross_entropy(
                logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            steps += 1
            if steps % 50 == 0 and rank == 0:
                log.info("epoch %d step %d loss %.4f", epoch, steps, float(np.mean(losses)))
            if steps == tc.max_steps:
                break
        train_seconds = time.perf_counter() - t0
        teacher.eval()
        ranks = sampled_ranks(
            teacher,
            [val["hist"][i][-tc.max_len :] for i in mine],
            [val["hist_fb"][i][-tc.max_len :] for i in mine],
            [val["valid"][i] for i in mine],
            [val["negatives"][i] for i in mine],
            titles,
            batch_size=64,
        )
        got = summarize(ranks)
        nd, hr = got["ndcg10"] * len(ranks), got["hr10"] * len(ranks)
        nd, hr, n, loss_sum, loss_n = all_sum([nd, hr, len(ranks), sum(losses), len(losses)], world)
        val_ndcg = nd / max(n, 1)
        best, bad = (val_ndcg, 0) if val_ndcg > best else (best, bad + 1)
        metrics = {
            "epoch": epoch,
            "loss": loss_sum / max(loss_n, 1),
            "val_sampled_ndcg10": val_ndcg,
            "val_sampled_hr10": hr / max(n, 1),
            "val_users": int(n),
            "best_val_sampled_ndcg10": best,
            "steps": steps,
            "train_seconds": train_seconds,
            "epoch_seconds": time.perf_counter() - t0,
        }
        history.append(metrics)
        state = {
            "model": teacher.state_dict(),
            "optimizer": opt.state_dict(),
            "epoch": epoch,
            "best": best,
            "bad": bad,
            "history": history,
        }
        report_epoch(rank, state, metrics)
        if bad >= tc.patience or out_of_time(started, tc.max_minutes, world):
            break


# ----------------------------------------------------------------------------- driver side


def train(
    dataset_uri: str,
    out: str,
    run: str,
    mc: TeacherConfig,
    tc: TeacherTrainConfig,
    resume: bool = False,
) -> dict:
    """Train the teacher and publish its best epoch; returns the job summary."""

    from models.teacher import build_teacher
    from pipelines.common.ray_runtime import init_ray

    t0 = time.perf_counter()
    dataset_uri, out = storage.pinned(dataset_uri), storage.absolute(out)
    marker = storage.read_marker(dataset_uri)
    seqs = user_sequences(dataset_uri)
    users = seqs.filter(seqs["hist"].list.len() >= 2).select("user_id", "hist", "hist_fb")
    rows = training_windows(users, tc.max_len).sample(fraction=1.0, shuffle=True, seed=tc.seed)
    if rows.height == 0:
        raise InputError(f"{dataset_uri}: no user has 2+ history items to train on")
    root = teacher_uri(out, run)
    train_root = storage.join(root, "train")
    resume_from = resume_point(train_root, run, resume)
    init_ray()
    config = {
        "train": dataclasses.asdict(tc),
        "teacher": mc.to_dict(),
        "dataset_uri": dataset_uri,
        "resume_from": resume_from,
        "threads": max(1, (os.cpu_count() or 1) // tc.workers),
        "val": sample_val(
            dataset_uri, tc.val_users, tc.seed, ("hist", "hist_fb", "valid", "negatives")
        ),
    }
    log.info(
        "training %s teacher %s on %d users (%d windows, %d prompts per epoch), %d worker(s)",
        mc.kind,
        run,
        users.height,
        rows.height,
        rows.height * tc.cuts * (1 + tc.negatives),
        tc.workers,
    )
    checkpoints = fit(
        train_loop,
        config,
        train_root=train_root,
        datasets={"train": epoch_shuffled(rows.to_arrow(), tc.seed, train_root)},
        workers=tc.workers,
        use_gpu=tc.use_gpu,
        max_failures=tc.max_failures,
    )
    history = [metrics for _, metrics in checkpoints]
    best_dir, best = max(checkpoints, key=lambda e: e[1]["val_sampled_ndcg10"])
    state = torch.load(open_file(best_dir, "state.pt"), map_location="cpu", weights_only=True)
    teacher = build_teacher(mc)
    teacher.load_state_dict(state["model"])
    pub = storage.Publication(root)
    try:
        with tempfile.TemporaryDirectory(prefix="kvrank-teacher-") as d:
            teacher.save(d)
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), "rb") as f:
                    pub.put_bytes(name, f.read())
        # the published folder is the model: loading it needs only the prompt settings
        prompt = dataclasses.replace(mc, model_dir=None)
        pub.put_bytes("teacher.json", prompt.to_json().encode())
        pub.put_bytes("train.json", json.dumps(dataclasses.asdict(tc), indent=2).encode())
        pub.put_bytes("metrics.json", json.dumps(history, indent=2).encode())
        pub.publish(
            {
                "kind": "teacher_checkpoint",
                "dataset_uri": dataset_uri,
                "dataset": marker["name"],
                "best_epoch": best["epoch"],
                "val_sampled_ndcg10": best["val_sampled_ndcg10"],
                "source": best_dir,
            }
        )
    except BaseException:
        pub.discard()
        raise
    return {
        "job": "train_teacher",
        "run": run,
        "kind": mc.kind,
        "users": users.height,
        "windows": rows.height,
        "parameters": sum(p.numel() for p in teacher.parameters()),
        "epochs_run": len(history),
        "best_epoch": best["epoch"],
        "val_sampled_ndcg10": round(best["val_sampled_ndcg10"], 4),
        "val_sampled_hr10": round(best["val_sampled_hr10"], 4),
        "mean_epoch_seconds": round(float(np.mean([h["epoch_seconds"] for h in history])), 1),
        "workers": tc.workers,
        "checkpoint": root,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.train_teacher", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--out", required=True, help="the teacher goes to <out>/teachers/<run>/")
    p.add_argument("--run", default=None, help="run name (default: <dataset>-teacher)")
    p.add_argument("--resume", action="store_true", help="continue the run's latest checkpoint")
    add_config_args(p, TeacherTrainConfig, "training")
    p.set_defaults(lr=None)  # by --kind, below
    g = p.add_argument_group("teacher")
    g.add_argument(
        "--kind",
        choices=TEACHER_KINDS,
        default="causal",
        help="causal: a small Llama on the MiniLM tokenizer, from scratch (vLLM serves it); "
        "cross: a cross-encoder fine-tuned from the pretrained MiniLM (models.teacher)",
    )
    base = TeacherConfig()
    for name in ("d_model", "n_layers", "n_heads", "ffn_dim", "max_history"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(base, name))
    g.add_argument("--max-length", type=int, default=None, help="prompt tokens (default: by kind)")
    g.add_argument(
        "--random-init",
        action="store_true",
        help="causal: random token embeddings instead of MiniLM's projected to --d-model; "
        "cross: MiniLM's shape with random weights",
    )
    a = p.parse_args(argv)
    for name, value in KIND_DEFAULTS[a.kind].items():
        if getattr(a, name) is None:
            setattr(a, name, value)

    def job() -> dict:
        marker = storage.read_marker(a.dataset_uri)
        mc = TeacherConfig(
            kind=a.kind,
            d_model=a.d_model,
            n_layers=a.n_layers,
            n_heads=a.n_heads,
            ffn_dim=a.ffn_dim,
            max_length=a.max_length,
            max_history=a.max_history,
            init_from_encoder=not a.random_init,
        )
        tc = config_from_args(a, TeacherTrainConfig)
        run = a.run or f"{marker['name']}-{'cross-' if a.kind == 'cross' else ''}teacher"
        return train(a.dataset_uri, a.out, run, mc, tc, a.resume)

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
