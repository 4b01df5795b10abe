"""Train the full-text teacher (models.teacher) with Ray Train, on the ranker's examples.

    python -m pipelines.train_teacher --dataset-uri out/datasets/ml-latest-small --out out \\
        [--run NAME] [--kind causal|cross] [--workers 1] [--epochs 4] [--cuts 1]
        [--negatives 7] [--resume] [--lr (by kind)] [--max-length (by kind)]
        [--d-model 128] [--n-layers 2] [--max-history 20] [--no-init-from-encoder]

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
from artifacts.data import (
    held_out_vids,
    item_titles,
    negative_pool,
    training_windows,
    user_sequences,
)
from models.config import TeacherConfig
from models.errors import InputError
from models.metrics import summarize
from pipelines.common import cli, jobs
from pipelines.common.teachers import sampled_ranks
from pipelines.common.training import (
    BaseTrainConfig,
    all_sum,
    epoch_shuffled,
    fit,
    open_file,
    restored_state,
    resume_check,
    train_epochs,
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
    pool = negative_pool(held_out_vids(config["dataset_uri"]), len(titles))
    state = restored_state()
    if state is not None:
        teacher.load_state_dict(state["model"])
    model = ray.train.torch.prepare_model(teacher)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    val = config["val"]
    mine = list(range(rank, len(val["valid"]), world))

    def step(batch: dict, rng) -> tuple[torch.Tensor, dict[str, float]]:
        """The teacher's loss on one batch: softmax over each cut's prompts (positive first)."""
        examples = []
        for v, f in zip(batch["hist"], batch["hist_fb"], strict=True):
            wv, wf = sample_window(v, f, rng, tc.max_len)
            t, cands = sample_candidates(
                wv, rng, n_items=len(titles), cuts=tc.cuts, negatives=tc.negatives, pool=pool
            )
            examples += examples_for(wv, wf, t, cands, titles)
        logits = model(teacher.tokenize(teacher.prompts(examples)))
        logits = logits.view(-1, 1 + tc.negatives)
        loss = torch.nn.functional.cross_entropy(
            logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device)
        )
        return loss, {"loss": loss.item()}

    def validation(_) -> dict[str, float]:
        """Sampled NDCG@10 of this worker's validation users, summed over every worker."""
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
        nd, hr, n = all_sum(
            [got["ndcg10"] * len(ranks), got["hr10"] * len(ranks), len(ranks)], world
        )
        return {
            "val_sampled_ndcg10": nd / max(n, 1),
            "val_sampled_hr10": hr / max(n, 1),
            "val_users": int(n),
        }

    train_epochs(
        model,
        opt,
        tc,
        rank=rank,
        world=world,
        state=state,
        step=step,
        validate=validation,
        score="val_sampled_ndcg10",
        log_every=50,
    )


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
    resume_check(train_root, run, resume)
    init_ray()
    config = {
        "train": dataclasses.asdict(tc),
        "teacher": mc.to_dict(),
        "dataset_uri": dataset_uri,
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
    trained = fit(
        train_loop,
        config,
        train_root=train_root,
        datasets={"train": epoch_shuffled(rows.to_arrow(), tc.seed, train_root)},
        workers=tc.workers,
        use_gpu=tc.use_gpu,
        max_failures=tc.max_failures,
        score="val_sampled_ndcg10",
    )
    history, best, best_dir = trained.history, trained.best_metrics, trained.best
    state = torch.load(open_file(best_dir, "state.pt"), map_location="cpu", weights_only=True)
    teacher = build_teacher(mc)
    teacher.load_state_dict(state["model"])
    publish_teacher(
        root,
        teacher,
        mc,
        tc,
        history,
        {
            "dataset_uri": dataset_uri,
            "dataset": marker["name"],
            "best_epoch": best["epoch"],
            "val_sampled_ndcg10": best["val_sampled_ndcg10"],
            "source": best_dir,
        },
    )
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


def publish_teacher(
    root: str, teacher, mc: TeacherConfig, tc: TeacherTrainConfig, history: list, marker: dict
) -> None:
    """Publish ``teacher`` to ``root``: its Hugging Face directory, the prompt settings
    (``teacher.json``), the training options and ``metrics.json`` (``history``), under a marker
    of kind teacher_checkpoint with the fields of ``marker``. Nothing is published on failure."""
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
        pub.publish({"kind": "teacher_checkpoint", **marker})
    except BaseException:
        pub.discard()
        raise


TEACHER_OPTIONS = ("kind", "d_model", "n_layers", "n_heads", "ffn_dim", "max_length")
TEACHER_OPTIONS += ("max_history", "init_from_encoder")


def build_parser() -> argparse.ArgumentParser:
    p = cli.job_parser("train_teacher", __doc__)
    p.add_argument("--dataset-uri", required=True, help="a prepared dataset (prepare_data)")
    p.add_argument("--out", required=True, help="the teacher goes to <out>/teachers/<run>/")
    p.add_argument("--run", default=None, help="run name (default: <dataset>-teacher)")
    p.add_argument("--resume", action="store_true", help="continue the run's latest checkpoint")
    cli.add_fields(p, TeacherTrainConfig, "training")
    cli.add_fields(p, TeacherConfig, "teacher", only=TEACHER_OPTIONS)
    for name in KIND_DEFAULTS["causal"]:  # by --kind
        action = next(x for x in p._actions if x.dest == name)
        action.default = None
        by_kind = ", ".join(f"{k} {d[name]}" for k, d in KIND_DEFAULTS.items())
        action.help = f"{action.help} (default: by --kind: {by_kind})"
    return p


def configs_from_args(a: argparse.Namespace) -> tuple[TeacherConfig, TeacherTrainConfig]:
    """The teacher's shape and its training options from parsed arguments, each option left
    unset taking its --kind's default."""
    for name, value in KIND_DEFAULTS[a.kind].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    return cli.from_args(a, TeacherConfig), cli.from_args(a, TeacherTrainConfig)


def main(argv: list[str] | None = None) -> int:
    a = cli.parse(build_parser(), argv)

    def job() -> dict:
        marker = storage.read_marker(a.dataset_uri)
        mc, tc = configs_from_args(a)
        run = a.run or f"{marker['name']}-{'cross-' if a.kind == 'cross' else ''}teacher"
        return train(a.dataset_uri, a.out, run, mc, tc, a.resume)

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
