"""Evaluate a trained ranker on the test split, with Ray Data, next to its baselines.

    python -m pipelines.evaluate --dataset-uri out/datasets/ml-latest-small \\
        --checkpoint out/checkpoints/ml-latest-small-text-id --out out \\
        [--id-checkpoint out/checkpoints/ml-latest-small-id] [--teacher out/teachers/RUN]
        [--teacher-engine hf|vllm]
        [--max-users N] [--report NAME]

Protocol (fixed by prepare_data): each user's history plus validation item is the input; the
test item is ranked (a) against the full catalog minus the items already in that input, and
(b) against the user's 100 sampled negatives. Reported: HR@10 and NDCG@10 for both, per model:

- ``ranker``: the checkpoint (item text vectors, MIS);
- ``ranker_id``: the same ranker trained with learned item-id embeddings (``--id-checkpoint``),
  which shows what the text encoder adds;
- ``most_popular``: items ranked by interaction count in the users' inputs;
- with ``--teacher``: a published text teacher (train_teacher), on the sampled protocol only
  (a full-catalog ranking by the teacher is one prompt per catalog item and user);
- with ``--user-states``: ``ranker`` is scored from the stored CollectiveKV states (read back,
  expanded, MIS - exactly the serving path, no fresh prefill), and ``uncompressed`` is the
  ranker its pools were fitted to, so the table shows what the compression costs. The states
  are a published folder (build_user_states) or a serving store (its ``store_uri``), read
  through the state-store interface as serving reads them; a user with events applied since
  the states were built is refused (their history is no longer the protocol's test input).

Beside the catalog-wide figures, the report gives each model's NDCG@10 by the test item's
popularity in the training inputs (``by_item_popularity``: the long tail), and, on a dataset
prepared with ``--holdout-items``, over the users whose test item is a held-out new item, one
no model trained on (``new_items``; up to ``--max-users`` more users are evaluated for it).

Users are scored by a Ray Data actor pool, each actor holding the model and the item table;
``--max-users`` evaluates a fixed random sample (seeded) when the full catalog times all users
is too much for the machine. Writes ``<out>/reports/<report>/``: metrics.json, per_user.parquet,
ndcg_by_history_length.png, ndcg_by_item_popularity.png, _SUCCESS.json.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np
import polars as pl
import pyarrow as pa

from artifacts import storage
from artifacts.data import held_out_vids, user_sequences
from models.errors import InputError
from models.metrics import ndcg_se, summarize
from pipelines.common import cli, jobs
from pipelines.common.plots import plot_lines
from pipelines.common.ranker_actors import map_with_rankers
from pipelines.common.scoring import ScoreUsers

log = logging.getLogger("kvrank.evaluate")

LENGTH_BUCKETS = (0, 5, 10, 20, 50, 100, 200, 500, 10**9)


def eval_users(
    dataset_uri: str, max_users: int | None, seed: int, held_out: np.ndarray | None = None
) -> pl.DataFrame:
    """Test inputs: history + validation item (with feedback), target = test item.
    ``in_sample``: the seeded sample of ``max_users`` (every user without it); with
    ``held_out`` (a dataset's new items) the users whose test item is one of them join it, up
    to ``max_users`` of them more (seeded), so new items are measured on as many users as the
    catalog-wide figures, which stay over the sample alone."""
    seqs = user_sequences(dataset_uri)

    def sample(idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if max_users and max_users < len(idx):
            return np.sort(rng.choice(idx, size=max_users, replace=False))
        return idx

    rows = sample(np.arange(seqs.height), np.random.default_rng(seed))
    in_sample = np.ones(len(rows), dtype=bool)
    if held_out is not None and len(held_out):
        new = np.flatnonzero(np.isin(seqs["test"].to_numpy(), held_out))
        extra = np.setdiff1d(sample(new, np.random.default_rng([seed, 1])), rows)
        rows = np.concatenate([rows, extra])
        in_sample = np.concatenate([in_sample, np.zeros(len(extra), dtype=bool)])
        order = np.argsort(rows)
        rows, in_sample = rows[order], in_sample[order]
    seqs = seqs[rows]
    return seqs.select(
        "user_id",
        pl.concat_list("hist", pl.col("valid")).alias("input"),
        pl.concat_list("hist_fb", pl.col("valid_fb")).alias("input_fb"),
        "test",
        "negatives",
    ).with_columns(pl.Series("in_sample", in_sample))


def input_counts(users: pl.DataFrame, n_items: int) -> np.ndarray:
    """How many times each vid occurs in ``users``' inputs (histories + validation items): an
    item's popularity in everything a model learns from."""
    return np.bincount(np.concatenate(users["input"].to_list()), minlength=n_items).astype(
        np.float64
    )


def popular_ranks(users: pl.DataFrame, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Most-popular baseline for ``users``: items by ``counts`` (``input_counts`` of every
    user), ranked like the model's (ties, e.g. among the many items of equal small counts,
    count against the target)."""
    sorted_counts = np.sort(counts)
    full, sampled = [], []
    for inp, t, neg in zip(
        users["input"].to_list(), users["test"].to_list(), users["negatives"].to_list(), strict=True
    ):
        c = counts[t]
        at_least = len(sorted_counts) - np.searchsorted(sorted_counts, c, side="left") - 1
        seen = np.unique(np.asarray(inp))
        full.append(at_least - int((counts[seen[seen != t]] >= c).sum()))
        sampled.append(int((counts[np.asarray(neg)] >= c).sum()))
    return np.array(full), np.array(sampled)


# lower edges of the test item's popularity buckets (its count in all users' inputs); the first
# bucket, 0, is the items no model learned from: held-out new items, or items seen only as tests
POPULARITY_EDGES = (0, 1, 5, 20, 100, 500)


def popularity_labels() -> list[str]:
    lows, highs = POPULARITY_EDGES, (*POPULARITY_EDGES[1:], None)
    return [
        str(lo) if hi == lo + 1 else f"{lo}+" if hi is None else f"{lo}-{hi - 1}"
        for lo, hi in zip(lows, highs, strict=True)
    ]


def by_popularity(per_user: pl.DataFrame, models: list[str]) -> dict:
    """Full-catalog NDCG@10 of each model over the users whose test item falls in each
    popularity bucket (the long tail on the left), for the buckets that have users."""
    bucket = np.digitize(per_user["test_popularity"].to_numpy(), POPULARITY_EDGES[1:])
    present = sorted(set(bucket.tolist()))
    labels = popularity_labels()
    return {
        "bucket": [labels[b] for b in present],
        "users": [int((bucket == b).sum()) for b in present],
        "ndcg10": {
            m: [
                round(summarize(per_user[f"{m}_full_rank"].to_numpy()[bucket == b])["ndcg10"], 4)
                for b in present
            ]
            for m in models
        },
    }


def new_item_metrics(per_user: pl.DataFrame, models: list[str]) -> dict:
    """Each model over the users whose test item is a held-out new item (full catalog): NDCG@10
    with its standard error, HR@10, and - since a new item rarely reaches a whole catalog's top
    10 - HR@100 and the median rank (0-based), where a model that cannot score it (the prior,
    most-popular) ranks it last."""
    new = per_user.filter("new_item")
    out: dict = {"users": new.height}
    for m in models:
        ranks = new[f"{m}_full_rank"].to_numpy()
        out[m] = {
            **summarize(ranks),
            "ndcg10_se": ndcg_se(ranks),
            "hr100": float((ranks < 100).mean()) if len(ranks) else float("nan"),
            "median_rank": float(np.median(ranks)) if len(ranks) else float("nan"),
        }
    return out


def check_stored_histories(users: pl.DataFrame, source: str, events_possible: bool) -> None:
    """Each stored state's history must be the end of its user's test input (history +
    validation item; states keep at most the newest ``max_len`` items): anything else would
    score another input than the protocol's, and a served store's events since the states were
    built may hold the very item under test."""
    bad = [
        uid
        for uid, h, inp in zip(users["user_id"], users["hist"], users["input"], strict=True)
        if len(h) == 0 or list(h) != list(inp[-len(h) :])
    ]
    if bad:
        why = (
            "events were applied to them since the states were built; evaluate the published "
            "states, or a store that has served no events"
            if events_possible
            else "were the states built from another dataset?"
        )
        raise InputError(
            f"{source}: the stored history of {len(bad)} test users (user {bad[0]} first) is "
            f"not the end of their test input: {why}"
        )


def plot_by_length(per_user: pl.DataFrame, models: list[str]) -> bytes:
    labels = [
        f"{lo + 1}-{hi}" if hi < 10**9 else f">{lo}"
        for lo, hi in zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:], strict=False)
    ]
    bucket = np.digitize(per_user["input_length"].to_numpy(), LENGTH_BUCKETS[1:-1], right=True)
    present = sorted(set(bucket.tolist()))
    series = {
        m: [
            summarize(per_user[f"{m}_full_rank"].to_numpy()[bucket == b])["ndcg10"] for b in present
        ]
        for m in models
    }
    return plot_lines([labels[b] for b in present], series, "history length (items)")


class TeacherRanks:
    """Ray Data callable class: rank of each user's test item among their sampled negatives,
    by a published teacher."""

    def __init__(self, teacher: str, dataset_uri: str, threads: int, engine: str = "hf") -> None:
        import torch

        from artifacts.data import item_titles
        from pipelines.common.teachers import load_teacher

        torch.set_num_threads(max(1, threads))
        with load_teacher(teacher, engine) as loaded:
            self.teacher = loaded
        self.titles = item_titles(dataset_uri)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from pipelines.common.teachers import sampled_ranks

        ranks = sampled_ranks(
            self.teacher,
            list(batch["input"]),
            list(batch["input_fb"]),
            list(batch["test"]),
            list(batch["negatives"]),
            self.titles,
            batch_size=128,
        )
        return {"user_id": batch["user_id"], "sampled_rank": ranks}


def evaluate(
    dataset_uri: str,
    checkpoint: str | None,
    out: str,
    *,
    user_states: str | None = None,
    id_checkpoint: str | None = None,
    vectors_uri: str | None = None,
    max_users: int | None = None,
    report: str | None = None,
    actors: int = 2,
    seed: int = 0,
    teacher: str | None = None,
    teacher_engine: str = "hf",
    item_prior: str | None = None,
) -> dict:
    import ray

    from pipelines.common.teachers import teacher_for_engine

    if teacher:
        teacher_for_engine(teacher, teacher_engine)  # fail here, not in every actor

    t0 = time.perf_counter()
    dataset_uri = storage.pinned(dataset_uri)
    held = held_out_vids(dataset_uri)
    users = eval_users(dataset_uri, max_users, seed, held)
    states_manifest, states_table, store_uri = None, None, None
    if user_states:
        from artifacts.state_store import is_store, read_served
        from artifacts.states import read_manifest, read_states

        if is_store(user_states):  # what the serving store holds now, events included
            store_uri = user_states
            user_states, states_table = read_served(store_uri, users["user_id"].to_list())
            states_manifest = read_manifest(user_states)
        else:
            user_states = storage.pinned(user_states)
            states_manifest, states_table = read_states(user_states)
        if states_manifest["includes_test"]:
            raise InputError(
                f"{user_states} includes each user's test item: build the states without "
                "--include-test to evaluate them"
            )
        if checkpoint and storage.pinned(checkpoint) != states_manifest["checkpoint"]:
            raise InputError(
                f"{user_states} was built with {states_manifest['checkpoint']}, not {checkpoint}"
            )
        checkpoint = states_manifest["checkpoint"]
        vectors_uri = vectors_uri or states_manifest.get("vectors_uri")
    if not checkpoint:
        raise InputError("give --checkpoint, or --user-states (which names its checkpoint)")
    checkpoint = storage.pinned(checkpoint)
    id_checkpoint = storage.pinned(id_checkpoint) if id_checkpoint else None
    vectors_uri = storage.pinned(vectors_uri) if vectors_uri else None
    item_prior = storage.pinned(item_prior) if item_prior else None  # refused before any work
    marker = storage.read_marker(dataset_uri)
    ckpt_marker = storage.read_marker(checkpoint)
    n_items = int(marker["items"])
    trained_weight = None
    if ckpt_marker.get("item_prior"):  # trained complementary to a prior: fused as trained
        if item_prior and item_prior != ckpt_marker["item_prior"]:
            raise InputError(
                f"{checkpoint} was trained complementary to the prior "
                f"{ckpt_marker['item_prior']}, not {item_prior}: evaluate it with its own"
            )
        item_prior, trained_weight = ckpt_marker["item_prior"], ckpt_marker["prior_weight"]
    if int(ckpt_marker["n_items"]) != n_items:
        raise InputError(
            f"{checkpoint} was trained on {ckpt_marker['n_items']} items, "
            f"{dataset_uri} has {n_items}"
        )
    per_user = users.select(
        "user_id", "in_sample", pl.col("input").list.len().alias("input_length")
    )
    if states_table is not None:
        stored = pl.from_arrow(states_table)
        missing = users.join(stored.select("user_id"), on="user_id", how="anti").height
        source = store_uri or user_states
        if missing:
            raise InputError(f"{source} has no state for {missing} of the test users")
        users = users.join(stored, on="user_id", how="left")
        check_stored_histories(users, source, events_possible=store_uri is not None)
    models = {"ranker": checkpoint} | ({"ranker_id": id_checkpoint} if id_checkpoint else {})
    if states_manifest is not None and ckpt_marker.get("base_checkpoint"):
        # the ranker the pools were fitted to, with its full KV: what compression costs
        models["uncompressed"] = ckpt_marker["base_checkpoint"]
    table = users.to_arrow()
    # with the prior, the fusion's pass ranks the ranker too (at weight 0)
    for name, ck in ((n, c) for n, c in models.items() if not (item_prior and n == "ranker")):
        log.info("scoring %d users with %s (%s)", users.height, name, ck)
        res = map_with_rankers(
            table,
            ScoreUsers,
            ck,
            vectors_uri,
            actors=actors,
            batch_size=16,
            extra_args=(states_table is not None and name == "ranker",),
        )
        ranks = pl.from_arrow(pa.concat_tables(ray.get(res.to_arrow_refs()))).select(
            "user_id",
            pl.col("full_rank").alias(f"{name}_full_rank"),
            pl.col("sampled_rank").alias(f"{name}_sampled_rank"),
        )
        per_user = per_user.join(ranks, on="user_id", how="left")
    fusion = None
    if item_prior:
        from pipelines.common.scoring import prior_fusion

        per_user, fusion = prior_fusion(
            per_user,
            table,
            checkpoint,
            vectors_uri,
            item_prior,
            actors,
            from_states=states_table is not None,
            trained_weight=trained_weight,
        )
    # popularity counts every user's input, not only the sampled ones'
    counts = input_counts(eval_users(dataset_uri, None, seed), n_items)
    pf, ps = popular_ranks(users, counts)
    test = users["test"].to_numpy()
    per_user = per_user.with_columns(
        pl.Series("most_popular_full_rank", pf),
        pl.Series("most_popular_sampled_rank", ps),
        pl.Series("test_popularity", counts[test].astype(np.int64)),
        pl.Series("new_item", np.isin(test, held)),
    )
    names = [*models, *(["item_prior", "ranker_prior"] if fusion else []), "most_popular"]
    sample = per_user.filter("in_sample")  # the catalog-wide figures: the seeded sample alone
    metrics = {
        m: {
            "full": summarize(sample[f"{m}_full_rank"].to_numpy()),
            "sampled": summarize(sample[f"{m}_sampled_rank"].to_numpy()),
        }
        for m in names
    }
    long_tail = by_popularity(sample, names)
    new_items = new_item_metrics(per_user, names) if len(held) else None
    if fusion:
        # what the served score adds over the prior alone, paired by user
        served, alone = (
            sample[f"{m}_full_rank"].to_numpy() for m in ("ranker_prior", "item_prior")
        )
        fusion["vs_prior"] = {
            "ndcg10_diff": metrics["ranker_prior"]["full"]["ndcg10"]
            - metrics["item_prior"]["full"]["ndcg10"],
            "se": ndcg_se(served, paired=alone),
        }
        metrics["ranker_prior"]["fusion"] = fusion
    if teacher:
        from pipelines.common.ranker_actors import map_with_pool
        from pipelines.common.ray_runtime import cluster_gpus

        teacher = storage.pinned(teacher)
        log.info("scoring %d users with the teacher (%s), sampled only", users.height, teacher)
        res = map_with_pool(
            users.select("user_id", "input", "input_fb", "test", "negatives").to_arrow(),
            TeacherRanks,
            lambda threads: (teacher, dataset_uri, threads, teacher_engine),
            actors=actors,
            batch_size=8,
            gpu=teacher_engine == "vllm" and cluster_gpus() > 0,
        )
        ranks = pl.from_arrow(pa.concat_tables(ray.get(res.to_arrow_refs())))
        per_user = per_user.join(
            ranks.rename({"sampled_rank": "teacher_sampled_rank"}), on="user_id", how="left"
        )
        metrics["teacher"] = {
            "sampled": summarize(per_user.filter("in_sample")["teacher_sampled_rank"].to_numpy())
        }
    report = report or (
        storage.name_of(user_states) + ("-store" if store_uri else "-states")
        if user_states
        else storage.name_of(checkpoint)
    )
    target = storage.join(out, "reports", report)
    summary = {
        "job": "evaluate",
        "dataset": marker["name"],
        "users": sample.height,
        "items": n_items,
        **{
            f"{m}_{p}_{k}": round(v, 4)
            for m in metrics
            for p in ("full", "sampled")
            if p in metrics[m]
            for k, v in metrics[m][p].items()
        },
        "report": target,
    }
    if fusion:
        summary["fusion_weight"] = fusion["weight"]
        summary["served_minus_prior_ndcg10"] = round(fusion["vs_prior"]["ndcg10_diff"], 4)
        summary["served_minus_prior_se"] = round(fusion["vs_prior"]["se"], 4)
    summary["by_item_popularity"] = long_tail
    if new_items:
        summary["new_item_users"] = new_items["users"]
        summary |= {f"{m}_new_full_ndcg10": round(new_items[m]["ndcg10"], 4) for m in names}
        summary |= {f"{m}_new_full_hr100": round(new_items[m]["hr100"], 4) for m in names}
        summary |= {f"{m}_new_median_rank": new_items[m]["median_rank"] for m in names}
    if store_uri:
        summary["store_uri"] = store_uri
    pub = storage.Publication(target)
    try:
        pub.put_bytes(
            "metrics.json",
            json.dumps(
                {
                    "dataset_uri": dataset_uri,
                    "checkpoint": checkpoint,
                    "id_checkpoint": id_checkpoint,
                    "teacher": teacher,
                    "user_states": user_states,
                    "store_uri": store_uri,
                    "item_prior": item_prior,
                    "users": sample.height,
                    "sampled_users": bool(max_users),
                    "metrics": metrics,
                    "by_item_popularity": long_tail,
                    "new_items": new_items,
                },
                indent=2,
            ).encode(),
        )
        pub.put_table("per_user.parquet", per_user.to_arrow())
        pub.put_bytes("ndcg_by_history_length.png", plot_by_length(sample, names))
        pub.put_bytes(
            "ndcg_by_item_popularity.png",
            plot_lines(
                long_tail["bucket"],
                long_tail["ndcg10"],
                "test item's interactions in the training inputs (the long tail on the left)",
            ),
        )
        pub.publish(
            {
                "kind": "report",
                "dataset": marker["name"],
                "checkpoint": checkpoint,
                "users": sample.height,
                # what Serve reads when given this report: what was measured, by version
                "user_states": user_states,
                "item_prior": item_prior,
                "fusion_weight": fusion["weight"] if fusion else None,
            }
        )
    except BaseException:
        pub.discard()
        raise
    summary["report"] = pub.uri  # the version folder: the files to open
    print(metrics_table(marker["name"], sample.height, metrics, new_items), file=sys.stderr)
    if states_manifest is not None:
        m = states_manifest
        summary |= {"state_bytes": m["state_bytes"], "ratio": round(m["ratio"], 5)}
        print(
            f"ranker scored from stored CollectiveKV states: {m['state_bytes']:,} bytes for "
            f"{m['users']:,} users ({m['state_bytes'] / max(1, m['users']):,.0f} per user), "
            f"{m['ratio']:.3%} of the {m['full_kv_bytes']:,} bytes of their fp16 KV",
            file=sys.stderr,
        )
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def metrics_table(dataset: str, users: int, metrics: dict, new_items: dict | None = None) -> str:
    lines = [
        f"{dataset}: {users} test users",
        f"{'model':<14} {'NDCG@10':>9} {'HR@10':>7} "
        f"{'NDCG@10 (100 neg)':>18} {'HR@10 (100 neg)':>16}",
    ]
    for m, v in metrics.items():
        full = (
            f"{v['full']['ndcg10']:>9.4f} {v['full']['hr10']:>7.4f}"
            if "full" in v
            else f"{'-':>9} {'-':>7}"
        )
        lines.append(
            f"{m:<14} {full} {v['sampled']['ndcg10']:>18.4f} {v['sampled']['hr10']:>16.4f}"
        )
    if new_items:
        lines.append(f"new (held-out) items: {new_items['users']} test users, full catalog")
        for m, v in new_items.items():
            if m != "users":
                nd, hr, se = v["ndcg10"], v["hr10"], v["ndcg10_se"]
                lines.append(
                    f"{m:<14} {nd:>9.4f} {hr:>7.4f}  (+/- {se:.4f}), HR@100 {v['hr100']:.4f}, "
                    f"median rank {v['median_rank']:,.0f}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("evaluate", __doc__)
    p.add_argument("--dataset-uri", required=True, help="the prepared dataset the ranker learned")
    p.add_argument("--checkpoint", help="a published ranker checkpoint folder")
    p.add_argument(
        "--user-states",
        help="score the ranker from stored compressed states, exactly as serving does: "
        "published states (build_user_states), or a serving store (a store_uri: a folder of "
        "shard databases or redis://) read as it holds them now; the checkpoint defaults to "
        "theirs",
    )
    p.add_argument(
        "--out", required=True, help="output root; the report goes to <out>/reports/<name>/"
    )
    p.add_argument("--id-checkpoint", help="the item-id baseline's checkpoint")
    p.add_argument("--teacher", help="a published teacher (train_teacher): sampled metrics")
    p.add_argument(
        "--teacher-engine",
        default="hf",
        help="hf or vllm (pipelines.common.vllm_engine) for --teacher",
    )
    p.add_argument(
        "--vectors-uri", help="item vectors (default: the ones the checkpoint was trained on)"
    )
    p.add_argument("--max-users", type=int, default=None, help="evaluate a seeded sample of users")
    p.add_argument("--report", default=None, help="report name (default: the checkpoint's)")
    p.add_argument(
        "--item-prior",
        help="an item prior (fit_item_prior): adds the prior alone and the ranker fused with it, "
        "the weight picked on the validation split (a ranker trained with --item-prior: its own "
        "prior, at its learned weight, without this option)",
    )
    p.add_argument(
        "--actors",
        type=int,
        default=2,
        help="scoring actors (Ray Data map_batches; never more than there are batches)",
    )
    a = cli.parse(p, argv)
    return jobs.run(
        lambda: evaluate(
            a.dataset_uri,
            a.checkpoint,
            a.out,
            user_states=a.user_states,
            id_checkpoint=a.id_checkpoint,
            vectors_uri=a.vectors_uri,
            max_users=a.max_users,
            report=a.report,
            actors=a.actors,
            teacher=a.teacher,
            teacher_engine=a.teacher_engine,
            item_prior=a.item_prior,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
