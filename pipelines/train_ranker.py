"""Train the personalized ranker with Ray Train, fed by Ray Data.

    python -m pipelines.train_ranker --dataset-uri out/datasets/ml-latest-small \\
        --vectors-uri out/item_vectors/ml-latest-small/minilm-l6-v2-265da472 --out out \\
        [--run NAME]
        [--workers 1] [--epochs 30] [--patience 4] [--resume] [--item-input text+id|text|id]
        [--teacher-labels LABELS [--distill-weight 1] [--distill-temperature 1]]
        [--item-prior out/item_priors/ml-latest-small/RUN [--prior-weight W]]
        [--prior-negatives M --negatives-prior out/item_priors/ml-latest-small/RUN]

An epoch is every user's history cut into windows of ``--max-len`` + 1 items (each item a
next-item target once). Each worker of a ``TorchTrainer`` (gloo DDP on CPUs, NCCL on GPUs) reads
its shard of the windows from Ray Data, 16 batches at a time, which it regroups into batches of
windows of similar lengths (a batch pads to its longest window: on short histories with a long
tail, mixed batches are mostly padding). Every batch samples, per window, ``--cuts`` cut points
and ``--negatives`` negatives per cut (``models.batches``), and trains the MIS forward with
softmax cross-entropy over each cut's candidates (positive first), plus, weighted by
``--catalog-weight``, the user token's softmax over the whole catalog for the next item after
every position of the window, plus the CollectiveKV aux loss when enabled. So training sees
exactly the attention pattern serving uses. With ``--teacher-labels`` (``pipelines.label_teacher``)
the windows, cut points and candidates are the labelled ones instead, and the loss gains
``--distill-weight`` x KL(teacher || ranker) over each cut's candidates at
``--distill-temperature``.

With ``--item-prior`` (``pipelines.fit_item_prior``) the ranker trains complementary to the
prior: every candidate's logit and every catalog logit is the ranker's score plus a learned
weight times the prior's score after the same history - the fused score serving ranks by - so
the ranker learns what the prior misses instead of relearning it. The weight starts where the
prior alone best predicts each user's last history item (or at ``--prior-weight``). Each
user's windows read a prior refitted without that user's fold (one of 5), never one that saw
the item it predicts; validation reads the published prior. The published
checkpoint names the prior and its learned weight, which evaluate and Serve then use.

With ``--prior-negatives M --negatives-prior P`` M of each cut's negatives are items the prior
P ranks in its top 100 after the history the cut shows (never one of the window's own items):
the head learns to order what the prior puts forward, as the served score must.

Each step also updates an exponential moving average of the weights (``--ema-decay``, 0: off);
the average, not the raw weights, is what is validated and published.

After every epoch the workers compute validation NDCG@10 over the full catalog for
``--val-users`` users (split across workers, each user's validation item ranked against every
item not in their history, by default by the user token's dot product alone - cheap enough for
every user of a small dataset - or, with ``--val-score served``, by the served score), and rank 0
reports a checkpoint (weights, their average, ranker config, optimizer, progress). Ray Train
tracks them under ``<out>/checkpoints/<run>/train/`` (``CheckpointConfig``: the best few by
validation NDCG@10 and the latest); ``FailureConfig`` restarts failed workers from the latest;
``--resume`` continues the run from it. Training stops early after ``--patience`` epochs
without a better validation score. The best epoch is then published to
``<out>/checkpoints/<run>/``: ``model.pt``, ``ranker.json``, ``metrics.json`` (per-epoch
history) and ``_SUCCESS.json`` naming the best epoch - the checkpoint the other jobs load.
"""

from __future__ import annotations

import argparse
import sys

from artifacts import storage
from models.config import CollectiveKVConfig, RankerConfig
from pipelines.common import cli, jobs
from pipelines.common.ranker_training import TrainConfig, add_train_args, train, train_config

RANKER_OPTIONS = ("item_input", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim")
RANKER_OPTIONS += ("ffn_dim", "dropout")


def build_parser() -> argparse.ArgumentParser:
    p = cli.job_parser("train_ranker", __doc__)
    p.add_argument("--dataset-uri", required=True, help="a prepared dataset (prepare_data)")
    p.add_argument(
        "--vectors-uri", help="item_vectors folder (default: the default encoder's under --out)"
    )
    p.add_argument(
        "--out", required=True, help="output root; checkpoints go to <out>/checkpoints/<run>/"
    )
    p.add_argument("--run", default=None, help="run name (default: <dataset>-<item-input>, + as -)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    p.add_argument(
        "--teacher-labels",
        default=None,
        help="a label_teacher folder: train on its examples with the distillation term",
    )
    g = p.add_argument_group("trained complementary to the item prior")
    g.add_argument(
        "--item-prior",
        default=None,
        help="a fit_item_prior folder: every logit in training is the ranker's score + a learned "
        "weight x this prior's, as it is served, so the ranker learns what the prior misses",
    )
    g.add_argument(
        "--prior-weight",
        type=float,
        default=0.0,
        help="with --item-prior: the prior's weight at the start, learned from there (default 0: "
        "calibrated, the weight at which the prior alone best predicts each user's last "
        "history item, by a prior fitted without that user)",
    )
    p.add_argument(
        "--negatives-prior",
        default=None,
        help="a fit_item_prior folder --prior-negatives of each cut's negatives are mined from",
    )
    add_train_args(p)
    cli.add_fields(p, RankerConfig, "ranker", only=RANKER_OPTIONS)
    g = p.add_argument_group("CollectiveKV trained from scratch (train_kv_pool fits it instead)")
    g.add_argument("--pool-size", type=int, default=0, help="pool size M (0: a plain KV cache)")
    g.add_argument("--user-dim", type=int, default=1, help="CollectiveKV d_u")
    return p


def configs_from_args(
    a: argparse.Namespace, feedback_classes: int
) -> tuple[RankerConfig, TrainConfig]:
    tc = train_config(a)
    ckv = CollectiveKVConfig(pool_size=a.pool_size, user_dim=a.user_dim) if a.pool_size else None
    rc = cli.from_args(
        a,
        RankerConfig,
        item_dim=a.d_model if a.item_input == "id" else RankerConfig.item_dim,
        feedback_classes=feedback_classes,
        collective_kv=ckv,
        prior_weight=a.prior_weight,
    )
    return rc, tc


def main(argv: list[str] | None = None) -> int:
    a = cli.parse(build_parser(), argv)

    def job() -> dict:
        marker = storage.read_marker(a.dataset_uri)
        rc, tc = configs_from_args(a, int(marker.get("feedback_classes", 5)))
        run = a.run or f"{marker['name']}-{a.item_input.replace('+', '-')}"
        vectors = a.vectors_uri
        if vectors is None and a.item_input != "id":
            from artifacts.data import default_vectors_uri

            vectors = default_vectors_uri(a.out, marker["name"])
        return train(
            a.dataset_uri,
            vectors,
            a.out,
            run,
            rc,
            tc,
            resume=a.resume,
            teacher_labels=a.teacher_labels,
            item_prior=a.item_prior,
            negatives_prior=a.negatives_prior,
        )

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
