"""Training the personalized ranker with Ray Train, fed by Ray Data: the training config, the
per-worker loop and the driver that runs it and publishes the best epoch (``train_ranker`` is
its command line; ``train_kv_pool`` fine-tunes through it).

``pipelines/train_ranker.py``'s docstring describes what one epoch is and what is published.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from artifacts import storage
from artifacts.data import (
    held_out_vids,
    item_table,
    negative_pool,
    training_windows,
    user_sequences,
)
from models.config import RankerConfig, option
from models.errors import InputError
from pipelines.common import cli, jobs
from pipelines.common.prior_offsets import (
    fold_priors,
    fused,
    load_negatives_prior,
    load_priors,
    prior_folds,
    prior_negatives,
    prior_offsets,
)
from pipelines.common.training import (
    BaseTrainConfig,
    convergence,
    epoch_shuffled,
    fit,
    open_file,
    optimizer,
    restored_state,
    resume_check,
    train_epochs,
    unwrap,
    weight_average,
)
from pipelines.common.validation import load_val, validate

log = logging.getLogger("kvrank.train_ranker")


VAL_SCORES = ("dot", "served")
TUNES = ("all", "kv")


@dataclass(frozen=True)
class TrainConfig(BaseTrainConfig):
    """How to train; the model's shape is the RankerConfig beside it."""

    # the user token's full-catalog softmax: on ml-latest-small it lifts validation NDCG@10
    # from ~0.02 (sampled negatives alone) to SASRec's level
    catalog_weight: float = option(
        1.0,
        "weight of the user token's softmax over the whole catalog for every next item (0: off)",
    )
    distill_weight: float = option(
        1.0, "with --teacher-labels: weight of KL(teacher || ranker) over each cut's candidates"
    )
    distill_temperature: float = option(
        1.0, "softmax temperature of both distillation terms (scaled by T^2)"
    )
    # the compressed ranker learns to score as the uncompressed one does, not only to fit the
    # labels again
    base_distill_weight: float = option(
        0.0,
        "a fine-tune (train_kv_pool): weight of KL(base || ranker) over each cut's candidates "
        "and the catalog softmax, base = the trained ranker it starts from, frozen",
    )
    tune: str = option(
        "all",
        "what a fine-tune trains: all weights, or kv: only the compressed cache's (CollectiveKV "
        "routers, pools, user projections), the rest frozen and run without dropout",
        choices=TUNES,
    )
    # on ml-latest-small, 128 users by the served score picked epochs whose test NDCG@10 was
    # 0.025-0.038: too noisy to choose from; dot validates every user of a small dataset
    val_score: str = option(
        "dot",
        "how validation ranks the catalog: dot (the user token's dot product: one matrix "
        "product) or served (head + dot by MIS, what serving returns; slower)",
        choices=VAL_SCORES,
    )
    prior_negatives: int = option(
        0,
        "with --negatives-prior: of each cut's --negatives, how many are drawn from the top "
        "items that item prior scores after the cut's history instead of uniformly",
    )
    # the raw weights' validation swung by more than its noise epoch to epoch on ml-latest-small
    ema_decay: float = option(
        0.995,
        "validate and publish an exponential moving average of the weights with this decay "
        "per step (0: the raw weights)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.val_score not in VAL_SCORES:
            raise InputError(f"--val-score must be one of {VAL_SCORES}, got {self.val_score!r}")
        if self.distill_weight < 0 or self.distill_temperature <= 0:
            raise InputError("--distill-weight must be >= 0 and --distill-temperature > 0")
        if self.tune not in TUNES:
            raise InputError(f"--tune must be one of {TUNES}, got {self.tune!r}")
        if self.base_distill_weight < 0:
            raise InputError(f"--base-distill-weight must be >= 0, got {self.base_distill_weight}")
        if self.catalog_weight < 0:
            raise InputError(f"--catalog-weight must be >= 0, got {self.catalog_weight}")
        if not 0 <= self.prior_negatives <= self.negatives:
            raise InputError(
                f"--prior-negatives must be in [0, --negatives = {self.negatives}], "
                f"got {self.prior_negatives}"
            )
        if not 0 <= self.ema_decay < 1:
            raise InputError(f"--ema-decay must be in [0, 1), got {self.ema_decay}")


def prepare_model(model: torch.nn.Module, prepare: tuple[str, dict] | list) -> None:
    """Call ``prepare``'s "module:function" on ``model`` with its kwargs."""
    import importlib

    target, kwargs = prepare
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(model, **kwargs)


def checkpoint_uri(out: str, run: str) -> str:
    return storage.join(out, "checkpoints", run)


# ----------------------------------------------------------------------------- worker side


def ranker_batches(rows: dict, rng, tc: TrainConfig, n_items: int, pool=None):
    """A chunk of training rows as ``TrainBatch``es of ``tc.batch_size`` windows of similar
    lengths (``models.batches.length_buckets``): each row's window is sampled first (a teacher's
    labelled window is taken whole, with its cut points, candidates and logits), then the
    windows are grouped by length, so a batch pads to about its own windows' length.
    ``pool``: the vids negatives are drawn from (a catalog without its held-out items)."""
    from models.batches import length_buckets, sample_window, training_batch

    labelled = "teacher_logits" in rows
    if labelled:
        windows = list(zip(rows["hist"], rows["hist_fb"], strict=True))
    else:
        windows = [
            sample_window(v, f, rng, tc.max_len)
            for v, f in zip(rows["hist"], rows["hist_fb"], strict=True)
        ]
    for idx in length_buckets([len(w[0]) for w in windows], tc.batch_size, rng):
        yield training_batch(
            [windows[i][0] for i in idx],
            [windows[i][1] for i in idx],
            rng,
            n_items=n_items,
            max_len=tc.max_len,
            cuts=tc.cuts,
            negatives=tc.negatives,
            windowed=True,
            given=([rows["cuts"][i] for i in idx], [rows["candidates"][i] for i in idx])
            if labelled
            else None,
            teacher=np.stack([rows["teacher_logits"][i] for i in idx]) if labelled else None,
            pool=pool,
            folds=np.asarray(rows["fold"])[idx] if "fold" in rows else None,
        )


def ranker_loss(
    model,
    tb,
    tc: TrainConfig,
    dev,
    base=None,
    held_out: torch.Tensor | None = None,
    priors=None,
    miner=None,
) -> tuple[torch.Tensor, dict]:
    """The ranker's loss on one ``TrainBatch``: softmax over each cut's candidates, the user
    token's catalog softmax, distillation from teacher labels and from the frozen ``base``, and
    the CollectiveKV routers' aux loss (minimised, not reported in "loss"). ``held_out``: vids
    (on ``dev``) the catalog softmax leaves out - a dataset's new items, never trained on.
    ``priors``: the out-of-fold item priors (``StackedPriors`` on ``dev``) of a ranker trained
    complementary to the prior: every logit is then the fused score, ranker + its
    ``prior_weight`` x the prior's score after the same history, as evaluation and serving
    score. ``miner``: the item prior (``StackedPriors`` on ``dev``) ``tc.prior_negatives`` of
    each cut's negatives are drawn from (``prior_negatives``)."""
    from models.ranker import distillation_loss, ranking_loss

    h = tb.history
    h = type(h)(h.vids.to(dev), h.feedback.to(dev), h.lengths.to(dev))
    catalog = tc.catalog_weight > 0
    next_vids = tb.next_vids.to(dev)
    rows = next_vids >= 0 if catalog else False  # logits only where a next item is
    cands, cut = tb.candidates.to(dev), tb.cut.to(dev)
    if miner is not None and tc.prior_negatives:
        cands = prior_negatives(
            miner, h.vids, next_vids, cands, cut, tc.negatives, tc.prior_negatives, held_out
        )
    out = model(h, cands, cut=cut, catalog=rows)
    offsets = None if priors is None else prior_offsets(priors, tb, h.vids, next_vids, cands, cut)
    out = fused(model, out, offsets, catalog)
    scores = out.scores.view(-1, 1 + tc.negatives)
    loss = ranking_loss(scores, torch.zeros(len(scores), dtype=torch.long, device=dev))
    if catalog:
        loss = loss + tc.catalog_weight * torch.nn.functional.cross_entropy(
            without(out.catalog, held_out), next_vids[rows]
        )
    distill = torch.zeros((), device=dev)
    if tb.teacher is not None and tc.distill_weight > 0:
        teacher = tb.teacher.to(dev)
        distill = distillation_loss(
            scores, teacher.view(-1, 1 + tc.negatives), tc.distill_temperature
        )
        loss = loss + tc.distill_weight * distill
    if base is not None:
        with torch.no_grad():
            ref = fused(base, base(h, cands, cut=cut, catalog=rows), offsets, catalog)
        t = tc.distill_temperature
        distill = distillation_loss(scores, ref.scores.view(-1, 1 + tc.negatives), t)
        if catalog:
            distill = distill + distillation_loss(
                without(out.catalog, held_out), without(ref.catalog, held_out), t
            )
        loss = loss + tc.base_distill_weight * distill
    parts = {
        "loss": loss.item(),
        "aux_loss": out.aux_loss.detach().item(),
        "distill_loss": distill.item(),
    }
    weight = getattr(model, "module", model).prior_weight
    if priors is not None and weight is not None:
        parts["prior_weight"] = weight.item()  # learned: the epoch's mean is in its metrics
    return loss + out.aux_loss, parts


def without(logits: torch.Tensor, vids: torch.Tensor | None) -> torch.Tensor:
    """Catalog logits with the columns ``vids`` pushed to the dtype's floor: out of the softmax
    (a probability of 0) but finite, so a KL term between two masked rows stays 0 there."""
    if vids is None:
        return logits
    return logits.index_fill(1, vids, torch.finfo(logits.dtype).min)


def train_loop(config: dict) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import ray.train.torch

    from artifacts.data import load_checkpoint
    from models.ranker import Ranker

    jobs.setup_logging()  # this worker's progress lines
    tc = TrainConfig(**config["train"])
    rc = RankerConfig.from_dict(config["ranker"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["threads"])
    torch.manual_seed(tc.seed)
    n_items = config["n_items"]
    model = Ranker(rc, n_items=n_items)
    if config.get("prepare"):  # a benchmark's change to the model, before any weight loads
        prepare_model(model, config["prepare"])
    if rc.reads_vectors:
        table, _ = item_table(config["vectors_uri"], n_items)
        model.set_item_table(table)
    state = restored_state()
    if state is not None:
        model.load_state_dict(state["model"])
    elif config.get("init_uri"):
        init = torch.load(
            open_file(*config["init_uri"].rsplit("/", 1)), map_location="cpu", weights_only=True
        )
        model.load_state_dict(init)
    if tc.tune == "kv":  # only the compressed cache learns; the rest stays the base's
        tuned = set(model.compressed_kv_parameters())
        for name, p in model.named_parameters():
            p.requires_grad_(name in tuned)
    model = ray.train.torch.prepare_model(model)
    dev = next(model.parameters()).device
    base = None
    if tc.base_distill_weight > 0:  # the frozen ranker a fine-tune distils from
        base, _ = load_checkpoint(config["base_uri"])
        if base.cfg.reads_vectors:
            base.set_item_table(table)
        base = base.to(dev).requires_grad_(False)
    opt = optimizer(model, tc)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    average = weight_average(unwrap(model), tc.ema_decay, state)
    held = np.asarray(config.get("held_out") or [], dtype=np.int64)
    pool = negative_pool(held, n_items)
    held_t = torch.from_numpy(held).to(dev) if len(held) else None
    priors = load_priors(config["priors_uri"]) if config.get("priors_uri") else None
    full_prior = priors.prior(len(priors.index) - 1) if priors else None  # fitted on everyone
    priors = priors.to(dev) if priors else None
    miner = None
    if config.get("negatives_prior"):
        miner = load_negatives_prior(config["negatives_prior"], n_items).to(dev)
    val = load_val(config["dataset_uri"], tc.val_users, tc.seed) if tc.val_users else None
    first = None
    if val and state is None and config.get("init_uri"):
        # a fine-tune: how its starting weights validate before any step, so the summary shows
        # what the fine-tune itself adds (or loses)
        start_val, _, n = validate(
            model, val, n_items, tc.max_len, rank, world, tc.val_score, full_prior
        )
        first = {"start_val_ndcg10": start_val}
        if rank == 0:
            log.info("starting weights: validation NDCG@10 %.4f (%d users)", start_val, n)

    def step(tb, rng) -> tuple[torch.Tensor, dict[str, float]]:
        return ranker_loss(model, tb, tc, dev, base, held_t, priors, miner)

    def validation(validated: torch.nn.Module) -> dict[str, float]:
        if not val:
            return {"val_ndcg10": 0.0, "val_hr10": 0.0, "val_users": 0}
        nd, hr, n = validate(
            validated, val, n_items, tc.max_len, rank, world, tc.val_score, full_prior
        )
        return {"val_ndcg10": nd, "val_hr10": hr, "val_users": int(n)}

    train_epochs(
        model,
        opt,
        tc,
        rank=rank,
        world=world,
        state=state,
        step=step,
        batches=lambda rows, rng: ranker_batches(rows, rng, tc, n_items, pool),
        validate=validation,
        score="val_ndcg10",
        average=average,
        # dropout only where weights learn the labels: with --tune kv the frozen layers run as
        # they serve, so the cache's KL to the base measures its own error, not dropout noise
        # (on amazon's a6, dropout alone put 0.19 of the fitted start's 0.37 between them)
        train_mode=tc.tune == "all",
        files={"ranker.json": rc.to_json()},
        first_metrics=first,
    )


# ----------------------------------------------------------------------------- driver side


def train(
    dataset_uri: str,
    vectors_uri: str | None,
    out: str,
    run: str,
    rc: RankerConfig,
    tc: TrainConfig,
    resume: bool = False,
    init_state: dict | None = None,
    extra_meta: dict | None = None,
    teacher_labels: str | None = None,
    base_uri: str | None = None,
    prepare: tuple[str, dict] | None = None,
    item_prior: str | None = None,
    negatives_prior: str | None = None,
) -> dict:
    """Train (or, with ``init_state``, fine-tune from those weights) and publish the best epoch.
    ``extra_meta`` goes into the published checkpoint's marker. With ``teacher_labels`` (a
    label_teacher folder) the epochs run over its labelled examples, with the distillation
    term. ``base_uri``: the published ranker a fine-tune distils from
    (``tc.base_distill_weight``). ``prepare``: ("module:function", kwargs), called on the model
    in every worker before weights load - how a benchmark trains a model it changed (a
    compressed-cache baseline); the published checkpoint then loads only through it.
    ``item_prior`` (a fit_item_prior folder): train complementary to it, its learned weight
    starting at ``rc.prior_weight`` (0: calibrated, ``calibrated_weight``): each user's windows
    read the offsets of a prior refitted without that user's fold, so no window is scored by a
    prior that saw its next item. ``negatives_prior`` (a fit_item_prior folder): the prior
    ``tc.prior_negatives`` of each cut's negatives are mined from."""

    from pipelines.common.ray_runtime import init_ray

    t0 = time.perf_counter()
    dataset_uri, out = storage.pinned(dataset_uri), storage.absolute(out)
    vectors_uri = storage.pinned(vectors_uri) if vectors_uri else None
    if tc.tune == "kv" and not (rc.collective_kv or prepare):
        raise InputError("--tune kv needs a compressed cache (CollectiveKV) to train")
    if tc.base_distill_weight > 0 and not base_uri:
        raise InputError(
            "--base-distill-weight needs the trained ranker a fine-tune starts from: "
            "train_kv_pool gives it, train_ranker alone has none"
        )
    marker = storage.read_marker(dataset_uri)
    n_items = int(marker["items"])
    if rc.reads_vectors:
        if not vectors_uri:
            raise InputError(f"--vectors-uri is required with --item-input {rc.item_input}")
        vmarker = storage.read_marker(vectors_uri)
        if int(vmarker["dim"]) != rc.item_dim:
            rc = dataclasses.replace(rc, item_dim=int(vmarker["dim"]))
    seqs = user_sequences(dataset_uri)
    users = seqs.filter(seqs["hist"].list.len() >= 2).select("user_id", "hist", "hist_fb")
    # an epoch is every user's history in windows of max_len + 1: each item a target once
    if teacher_labels:
        labels, tc = _labelled_examples(storage.pinned(teacher_labels), dataset_uri, tc)
        extra_meta = {**(extra_meta or {}), "teacher_labels": storage.pinned(teacher_labels)}
    else:
        labels = training_windows(users, tc.max_len)
    if rc.prior_weight < 0 or (rc.prior_weight > 0 and not item_prior):
        raise InputError(
            "--prior-weight is the starting weight of the prior a ranker trains complementary "
            f"to: it needs --item-prior (a fit_item_prior folder) and must be > 0, got "
            f"{rc.prior_weight}"
        )
    if bool(tc.prior_negatives) != bool(negatives_prior):
        raise InputError(
            "--prior-negatives and --negatives-prior go together: fit the prior first "
            "(pipelines.fit_item_prior) and give its folder as --negatives-prior"
        )
    if teacher_labels and tc.prior_negatives:
        raise InputError("--prior-negatives: a teacher's labelled examples keep their candidates")
    if negatives_prior:
        negatives_prior = storage.pinned(negatives_prior)
        extra_meta = {**(extra_meta or {}), "negatives_prior": negatives_prior}
    if item_prior:
        item_prior = storage.pinned(item_prior)
        folds = prior_folds(users["user_id"].to_numpy(), tc.seed)
        labels = labels.join(
            pl.DataFrame({"user_id": users["user_id"], "fold": folds}),
            on="user_id",
            maintain_order="left",
        )
    train_rows = labels.sample(fraction=1.0, shuffle=True, seed=tc.seed)
    if train_rows.height == 0:
        raise InputError(f"{dataset_uri}: no user has 2+ history items to train on")
    root = checkpoint_uri(out, run)
    train_root = storage.join(root, "train")
    resume_check(train_root, run, resume)
    init_uri = None
    if init_state is not None and not resume:
        init_uri = storage.join(train_root, "init", "model.pt")
        buf = io.BytesIO()
        torch.save(init_state, buf)
        storage.write_bytes(init_uri, buf.getvalue())
    priors_uri = None
    if item_prior:
        priors_uri = storage.join(train_root, "priors.pt")
        calibrated = fold_priors(item_prior, dataset_uri, users, folds, n_items, priors_uri)
        if rc.prior_weight == 0:
            rc = dataclasses.replace(rc, prior_weight=calibrated)
    init_ray()
    ds = epoch_shuffled(train_rows.to_arrow(), tc.seed, train_root)
    config = {
        "train": dataclasses.asdict(tc),
        "ranker": rc.to_dict(),
        "n_items": n_items,
        "vectors_uri": vectors_uri,
        "dataset_uri": dataset_uri,
        "init_uri": init_uri,
        "base_uri": storage.pinned(base_uri) if base_uri else None,
        "prepare": prepare,
        "threads": max(1, (os.cpu_count() or 1) // tc.workers),
        # new items (prepare_data --holdout-items): never a negative, never in the catalog softmax
        "held_out": held_out_vids(dataset_uri).tolist(),
        "priors_uri": priors_uri,
        "negatives_prior": negatives_prior,
    }
    log.info(
        "training %s on %d users (%d windows), %d items, %d worker(s)",
        run,
        users.height,
        train_rows.height,
        n_items,
        tc.workers,
    )
    trained = fit(
        train_loop,
        config,
        train_root=train_root,
        datasets={"train": ds},
        workers=tc.workers,
        use_gpu=tc.use_gpu,
        max_failures=tc.max_failures,
        score="val_ndcg10",
    )
    history, best, best_dir = trained.history, trained.best_metrics, trained.best
    last = history[-1]
    state = torch.load(open_file(best_dir, "state.pt"), map_location="cpu", weights_only=True)
    buf = io.BytesIO()
    published = state.get("published")  # None: no average (or a checkpoint from before it)
    weights = state["model"] if published is None else published
    torch.save(weights, buf)
    pub = storage.Publication(root)
    summary = {
        "job": "train_ranker",
        "run": run,
        "item_input": rc.item_input,
        "users": users.height,
        "windows": train_rows.height,
        "distilled": bool(teacher_labels) and tc.distill_weight > 0,
        "items": n_items,
        "epochs_run": len(history),
        "best_epoch": best["epoch"],
        "val_ndcg10": round(best["val_ndcg10"], 4),
        "val_hr10": round(best["val_hr10"], 4),
        "last_epoch": last["epoch"],
        **convergence(history, tc, "val_ndcg10"),
        "mean_epoch_seconds": round(float(np.mean([h["epoch_seconds"] for h in history])), 1),
        "workers": tc.workers,
        "checkpoint": root,
    }
    if item_prior:  # the fusion it was trained as: its weight is the model's
        summary["prior_weight"] = round(rc.prior_weight * float(weights["prior_gain"].exp()), 4)
        summary["prior_weight_start"] = round(rc.prior_weight, 4)
        extra_meta = {
            **(extra_meta or {}),
            "item_prior": item_prior,
            "prior_weight": summary["prior_weight"],
        }
    if summary["val_still_rising"]:
        log.warning(
            "validation NDCG@10 was still rising at the last epoch (stopped by %s): more "
            "epochs (--epochs, --max-minutes) would likely train a better ranker",
            summary["stopped_by"],
        )
    if "start_val_ndcg10" in history[0]:  # a fine-tune's starting weights, validated
        summary["start_val_ndcg10"] = round(history[0]["start_val_ndcg10"], 4)
    try:
        pub.put_bytes("model.pt", buf.getvalue())
        pub.put_bytes("ranker.json", rc.to_json().encode())
        pub.put_bytes("train.json", json.dumps(dataclasses.asdict(tc), indent=2).encode())
        pub.put_bytes("metrics.json", json.dumps(history, indent=2).encode())
        pub.publish(
            {
                "kind": "ranker_checkpoint",
                "dataset_uri": dataset_uri,
                "vectors_uri": vectors_uri,
                "best_epoch": best["epoch"],
                "val_ndcg10": best["val_ndcg10"],
                "source": best_dir,
                "latest": trained.latest,
                "n_items": n_items,
                "prepare": prepare,
                **(extra_meta or {}),
            }
        )
    except BaseException:
        pub.discard()
        raise
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def _labelled_examples(labels_uri: str, dataset_uri: str, tc: TrainConfig):
    """The rows of a label_teacher folder, and ``tc`` with its cuts and negatives."""
    marker = storage.read_marker(labels_uri)
    if marker.get("kind") != "teacher_labels":
        raise InputError(f"{labels_uri} is not a label_teacher output")
    if marker["dataset_uri"] != dataset_uri:
        raise InputError(
            f"{labels_uri} labels {marker['dataset_uri']}, not the dataset {dataset_uri}"
        )
    if marker["max_len"] > tc.max_len:
        raise InputError(
            f"{labels_uri} has windows of {marker['max_len']} + 1 items; --max-len is {tc.max_len}"
        )
    if (marker["cuts"], marker["negatives"]) != (tc.cuts, tc.negatives):
        log.info(
            "teacher labels: %d cuts x %d negatives per window (instead of %d x %d)",
            marker["cuts"],
            marker["negatives"],
            tc.cuts,
            tc.negatives,
        )
    tc = dataclasses.replace(tc, cuts=marker["cuts"], negatives=marker["negatives"])
    table = storage.read_table(labels_uri, "labels.parquet")
    return pl.from_arrow(table), tc


def add_train_args(p: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field (--epochs, --lr, ...), shared with train_kv_pool."""
    cli.add_fields(p, TrainConfig, "training")


def train_config(a: argparse.Namespace) -> TrainConfig:
    return cli.from_args(a, TrainConfig)
