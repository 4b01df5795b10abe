"""Prepare a dataset: raw catalog + interaction log -> the three Parquet tables every job reads.

    python -m pipelines.prepare_data --dataset ml-latest-small --out ./out
    python -m pipelines.prepare_data --dataset shop --items items.csv --text-cols title,brand \\
        --interactions log.parquet --user-col uid --item-col sku --time-col ts --out s3://b/kv
    python -m pipelines.prepare_data --dataset ml-latest-small --out ./out \\
        --online-events out/serving/ml-latest-small-ckv     # + the events the store acknowledged

Writes under ``<out>/datasets/<name>/`` (see DESIGN "Data model"):

- ``items.parquet``: item_id, vid (dense 0..N-1 in item_id order), text, content_hash, extras;
- ``interactions.parquet``: user_id, item_id, ts, feedback (rating bucket, -1 when unknown),
  sorted by user then time (ties keep the source order);
- ``splits.parquet``: leave-one-out per user - the last item is the test item, the one before it
  the validation item, the rest the history (with its feedback and ts) - and ``negatives``:
  item ids the user never interacted with, sampled uniformly with a per-user seed so the same
  user gets the same negatives however the job is partitioned. Users with fewer than 3
  interactions cannot be split and are left out of this table (counted in the summary).

The transform runs in polars (columnar, streaming collect), so memory follows the Arrow columns,
not Python objects per row; it runs the same in-process or under ``ray job submit``, and needs
no Ray workers: on a single node, polars handles tens of millions of interactions in seconds.

``--holdout-items F`` holds out a seeded share F of the items the log names, for the cold-start
evaluation: their interactions leave every user's sequence except as that user's last (the test
item), so no model trains on them; ``held_out.parquet`` names them (``artifacts.data``).

``--online-events STORE_URI`` adds every event a serving store acknowledged (its shards' durable
history: user, item, feedback, in the order they were applied) after each user's interactions,
so the next model's states are built from everything users did, not only from the last
published data. The store names the states it served and through them the dataset whose vids
its events use; those vids are mapped back to item ids, which the catalog must still hold.

Nothing is written until every check has passed, and the output is published atomically
(``artifacts.storage.Publication``), so a failed run never replaces a published dataset.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from artifacts import storage
from models.config import option
from models.errors import InputError
from pipelines.common import cli, jobs, sources

log = logging.getLogger("kvrank.prepare_data")

DEFAULT_THRESHOLDS = (1.5, 2.5, 3.5, 4.5)  # 5 feedback buckets on a 0.5..5 or 1..5 star scale


@dataclass(frozen=True)
class PrepareConfig:
    """How interactions become feedback, splits and negatives."""

    negatives: int = option(100, "sampled negatives stored per test user (the sampled metrics)")
    seed: int = option(0, "base seed of the per-user negative sampler (and of --holdout-items)")
    # the cold-start protocol: a share of the catalog the models never train on, evaluated on
    # the users whose test item is one of them (evaluate reports them as "new items")
    holdout_items: float = option(
        0.0,
        "share of the interacted items held out as new items: removed from every history and "
        "validation item, kept only as a test item (0: none)",
    )
    rating_thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS  # feedback = #thresholds <= rating

    def __post_init__(self) -> None:
        if self.negatives < 0:
            raise InputError(f"--negatives must be >= 0, got {self.negatives}")
        if not 0 <= self.holdout_items < 1:
            raise InputError(f"--holdout-items must be in [0, 1), got {self.holdout_items}")
        if list(self.rating_thresholds) != sorted(self.rating_thresholds):
            raise InputError(
                f"--rating-thresholds must be increasing, got {self.rating_thresholds}"
            )

    @property
    def feedback_classes(self) -> int:
        return len(self.rating_thresholds) + 1


def dataset_uri(out: str, name: str) -> str:
    return storage.join(out, "datasets", name)


def build_items(source: sources.Source) -> pl.DataFrame:
    """Validate the catalog and give it dense vids and content hashes."""
    label = source.items_file
    items = sources.collect(source.items, label)
    dup = items.filter(pl.col("item_id").is_duplicated())
    if dup.height:
        ids = dup["item_id"].unique().sort().head(5).to_list()
        raise InputError(
            f"{label}: column item_id has {dup['item_id'].n_unique()} duplicated id(s) "
            f"in {dup.height} rows (e.g. {ids})"
        )
    empty = items.filter(pl.col("text").is_null() | (pl.col("text").str.strip_chars() == ""))
    if empty.height:
        ids = empty["item_id"].head(5).to_list()
        raise InputError(f"{label}: {empty.height} item(s) have empty text (e.g. item_id {ids})")
    items = items.sort("item_id").with_columns(
        pl.int_range(pl.len(), dtype=pl.Int32).alias("vid"),
        pl.col("text").str.strip_chars(),
    )
    items = items.with_columns(sources.content_hash(items["text"]))
    front = ["item_id", "vid", "text", "content_hash"]
    return items.select(front + [c for c in items.columns if c not in front])


def build_interactions(
    source: sources.Source, items: pl.DataFrame, cfg: PrepareConfig
) -> pl.DataFrame:
    """Check item ids against the catalog, bucket ratings, sort by user and time."""
    label = source.interactions_file
    lf = source.interactions.join(
        items.lazy().select("item_id", pl.lit(True).alias("_known")), on="item_id", how="left"
    )
    thresholds = cfg.rating_thresholds
    feedback = pl.sum_horizontal([(pl.col("rating") >= t).cast(pl.Int8) for t in thresholds])
    df = sources.collect(
        lf.with_columns(
            pl.when(pl.col("rating").is_null())
            .then(-1)
            .otherwise(feedback)
            .cast(pl.Int8)
            .alias("feedback")
        ),
        label,
    )
    unknown = df.filter(pl.col("_known").is_null())
    if unknown.height:
        ids = unknown["item_id"].unique().sort().head(5).to_list()
        raise InputError(
            f"{label}: {unknown.height} interaction(s) name items that are not in the catalog "
            f"(e.g. item_id {ids})"
        )
    if df.height == 0:
        raise InputError(f"{label}: no interactions")
    return df.sort(["user_id", "ts", "row"]).select("user_id", "item_id", "ts", "feedback")


def online_interactions(
    store_uri: str, interactions: pl.DataFrame, items: pl.DataFrame, cfg: PrepareConfig
) -> pl.DataFrame:
    """The events the store at ``store_uri`` acknowledged, as interaction rows placed after each
    user's last one in the order they were applied (times are per-user positions from there)."""
    from artifacts.state_store import read_history

    parts, item_ids = [], {}
    for states_uri, events in read_history(store_uri):
        if not events:
            continue
        if states_uri is None:
            raise InputError(f"store {store_uri}: a shard has events but no states it loaded")
        dataset = storage.read_marker(states_uri)["dataset_uri"]
        if dataset not in item_ids:
            served = storage.read_table(dataset, "items.parquet", columns=["item_id", "vid"])
            item_ids[dataset] = served.column("item_id").to_numpy()[
                np.argsort(served.column("vid").to_numpy())
            ]
        user, vid, feedback, _ = (np.asarray(c) for c in zip(*events, strict=True))
        parts.append(
            pl.DataFrame(
                {
                    "user_id": user.astype(np.int64),
                    "item_id": item_ids[dataset][vid],
                    "feedback": feedback.astype(np.int8),
                }
            )
        )
    if not parts:
        return interactions.head(0)
    online = pl.concat(parts).with_row_index("_order")
    unknown = online.join(items.select("item_id"), on="item_id", how="anti")
    if unknown.height:
        ids = unknown["item_id"].unique().sort().head(5).to_list()
        raise InputError(
            f"store {store_uri}: {unknown.height} event(s) name items no longer in the catalog "
            f"(e.g. item_id {ids})"
        )
    if online["feedback"].max() >= cfg.feedback_classes:
        raise InputError(
            f"store {store_uri}: feedback up to {online['feedback'].max()}, but these "
            f"--rating-thresholds make {cfg.feedback_classes} classes"
        )
    last = interactions.group_by("user_id").agg(pl.col("ts").max().alias("_last"))
    ts_type = interactions.schema["ts"]
    return (
        online.join(last, on="user_id", how="left")
        .with_columns(
            (
                pl.col("_last").fill_null(0)
                + pl.col("_order").rank("ordinal").over("user_id").cast(ts_type)
            ).alias("ts")
        )
        .sort("_order")
        .select(interactions.columns)
        .cast(interactions.schema)
    )


def sample_negatives(
    user_ids: np.ndarray, seen: list[np.ndarray], catalog: np.ndarray, k: int, seed: int
) -> list[np.ndarray]:
    """``k`` distinct item ids per user from ``catalog`` minus the items that user has ``seen``.

    Each user's generator is seeded by (seed, user_id): the result does not depend on the order
    or batching of users. Shapes: user_ids (U,), seen[i] (n_i,), catalog (N,) -> U arrays of (k,).
    """
    out = []
    n = len(catalog)
    for uid, s in zip(user_ids, seen, strict=True):
        seen_vids = np.unique(np.searchsorted(catalog, s))
        free = n - len(seen_vids)
        if free < k:
            raise InputError(
                f"user {uid} interacted with {len(seen_vids)} of {n} catalog items, leaving "
                f"{free} possible negatives; lower --negatives below {k}"
            )
        rng = np.random.default_rng([seed, int(uid) & 0xFFFFFFFF, int(uid) >> 32])
        # Draw in index space over the free items: position p maps to the p-th unseen vid, so
        # every draw is valid and no rejection loop is needed.
        picks = rng.choice(free, size=k, replace=False)
        vids = picks + np.searchsorted(seen_vids - np.arange(len(seen_vids)), picks, side="right")
        out.append(catalog[vids])
    return out


def hold_out_items(interactions: pl.DataFrame, cfg: PrepareConfig) -> tuple[pl.DataFrame, list]:
    """The cold-start protocol: ``cfg.holdout_items`` of the items the log names, drawn with
    ``cfg.seed``, leave every user's sequence except as that user's last interaction (their
    test item), so no history, validation item, prior or popularity count ever holds one.
    Returns (the interactions left, the held-out item ids sorted)."""
    if cfg.holdout_items == 0:
        return interactions, []
    named = interactions["item_id"].unique().sort()
    n = int(round(cfg.holdout_items * len(named)))
    picks = np.random.default_rng([cfg.seed, 0x401D]).choice(len(named), n, replace=False)
    held = named.gather(np.sort(picks))
    last = pl.int_range(pl.len()).over("user_id") == pl.len().over("user_id") - 1
    kept = interactions.filter(~pl.col("item_id").is_in(held.implode()) | last)
    return kept, held.to_list()


def build_splits(
    interactions: pl.DataFrame, items: pl.DataFrame, cfg: PrepareConfig
) -> pl.DataFrame:
    """Leave-one-out splits with sampled negatives (see the module docstring)."""
    per_user = (
        interactions.lazy()
        .group_by("user_id", maintain_order=True)
        .agg(pl.col("item_id"), pl.col("feedback"), pl.col("ts"))
        .filter(pl.col("item_id").list.len() >= 3)
        .select(
            "user_id",
            pl.col("item_id").list.slice(0, pl.col("item_id").list.len() - 2).alias("history"),
            pl.col("feedback")
            .list.slice(0, pl.col("feedback").list.len() - 2)
            .alias("history_feedback"),
            pl.col("ts").list.slice(0, pl.col("ts").list.len() - 2).alias("history_ts"),
            pl.col("item_id").list.get(-2).alias("valid_item"),
            pl.col("feedback").list.get(-2).alias("valid_feedback"),
            pl.col("item_id").list.get(-1).alias("test_item"),
            pl.col("feedback").list.get(-1).alias("test_feedback"),
            pl.col("item_id").alias("_all"),
        )
        .collect(engine="streaming")
    )
    catalog = items["item_id"].to_numpy()  # sorted, since vids follow item_id order
    seen = [s.to_numpy() for s in per_user["_all"]]
    negatives = sample_negatives(
        per_user["user_id"].to_numpy(), seen, catalog, cfg.negatives, cfg.seed
    )
    neg = pl.Series("negatives", negatives).cast(pl.List(pl.Int64))
    return per_user.drop("_all").with_columns(neg)


def prepare(
    source: sources.Source, out: str, cfg: PrepareConfig, online_events: str | None = None
) -> dict:
    """Build, check and publish the dataset; returns the summary."""
    t0 = time.perf_counter()
    target = dataset_uri(out, source.name)
    log.info("[1/4] items: validating the catalog")
    items = build_items(source)
    log.info("[2/4] interactions: checking item ids, bucketing feedback, sorting")
    interactions = build_interactions(source, items, cfg)
    online = 0
    if online_events:
        extra = online_interactions(online_events, interactions, items, cfg)
        online = extra.height
        log.info("[2/4] %d acknowledged event(s) from the store %s", online, online_events)
        interactions = pl.concat([interactions, extra]).sort("user_id", "ts", maintain_order=True)
    interactions, held = hold_out_items(interactions, cfg)
    if held:
        log.info("[3/4] %d item(s) held out: only ever a test item", len(held))
    log.info("[3/4] splits: leave-one-out and %d sampled negatives per user", cfg.negatives)
    splits = build_splits(interactions, items, cfg)
    counts = interactions.group_by("user_id").len()["len"]
    hist = splits["history"].list.len()
    summary = {
        "job": "prepare_data",
        "dataset": source.name,
        "users": int(counts.len()),
        "items": items.height,
        "interactions": interactions.height,
        "online_events": online,
        "held_out_items": len(held),
        "new_item_test_users": int(splits["test_item"].is_in(held).sum()) if held else 0,
        "split_users": splits.height,
        "users_too_short": int(counts.len() - splits.height),
        "mean_history_length": round(float(hist.mean()), 2) if splits.height else 0.0,
        "max_history_length": int(hist.max()) if splits.height else 0,
        "out": target,
    }
    log.info("[4/4] publishing to %s", target)
    pub = storage.Publication(target)
    try:
        pub.put_table("items.parquet", items.to_arrow())
        pub.put_table("interactions.parquet", interactions.to_arrow())
        pub.put_table("splits.parquet", splits.to_arrow())
        if held:
            pub.put_table("held_out.parquet", pl.DataFrame({"item_id": held}).to_arrow())
        pub.publish(
            {
                "kind": "dataset",
                "name": source.name,
                "description": source.description,
                "sources": [source.items_file, source.interactions_file, *source.extra_files],
                "online_events": {"store": online_events, "events": online},
                "ts_kind": source.ts_kind,
                "feedback_classes": cfg.feedback_classes,
                "held_out_items": len(held),
                "config": asdict(cfg),
                **{k: summary[k] for k in ("users", "items", "interactions", "split_users")},
            }
        )
    except BaseException:
        pub.discard()
        raise
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary


def load_dataset(uri: str) -> dict[str, pl.DataFrame]:
    """Read a published dataset folder (refuses an incomplete one)."""
    storage.read_marker(uri)
    return {
        name: pl.from_arrow(storage.read_table(uri, f"{name}.parquet"))
        for name in ("items", "interactions", "splits")
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.job_parser("prepare_data", __doc__)
    p.add_argument(
        "--dataset",
        required=True,
        help=f"built-in ({', '.join(sources.BUILTIN)}) or a name for your own data",
    )
    p.add_argument(
        "--out", required=True, help="output root URI (local path or s3://bucket/prefix)"
    )
    p.add_argument(
        "--data-dir",
        help="folder with the built-in datasets (default: $KVRANK_DATA_DIR, ../shared/data)",
    )
    p.add_argument(
        "--online-events",
        metavar="STORE_URI",
        help="also every event a serving store acknowledged (its store_uri: a local folder or "
        "redis://...), after each user's interactions",
    )
    cli.add_fields(p, PrepareConfig, "splits", only=("negatives", "seed", "holdout_items"))
    p.add_argument(
        "--rating-thresholds",
        default=",".join(map(str, DEFAULT_THRESHOLDS)),
        help="increasing rating cut points; feedback = how many a rating reaches",
    )
    g = p.add_argument_group("bring your own data")
    g.add_argument("--items", help="items file (csv, tsv or parquet; local or s3://)")
    g.add_argument("--item-id-col", default="item_id", help="the items file's id column")
    g.add_argument(
        "--text-cols", default="title", help="comma-separated text columns, joined with ' | '"
    )
    g.add_argument("--interactions", help="interaction rows: user, item, timestamp[, rating]")
    g.add_argument("--user-col", default="user_id", help="the interactions' user column")
    g.add_argument("--item-col", default="item_id", help="the interactions' item column")
    g.add_argument(
        "--time-col", default="timestamp", help="the interactions' time column (orders history)"
    )
    g.add_argument(
        "--rating-col", default=None, help="the interactions' rating column (feedback buckets)"
    )
    g.add_argument(
        "--sequences", help="one row per user: user id and space-separated item ids in order"
    )
    g.add_argument("--seq-user-col", default="user_id", help="the sequences' user column")
    g.add_argument("--seq-items-col", default="item_ids", help="the sequences' item-ids column")
    return cli.parse(p, argv)


def source_from_args(a: argparse.Namespace) -> sources.Source:
    if a.items is None:
        if a.interactions or a.sequences:
            raise InputError("--interactions/--sequences need --items (the catalog)")
        return sources.builtin(a.dataset, a.data_dir)
    spec = sources.CustomSpec(
        name=a.dataset,
        items=a.items,
        item_id_col=a.item_id_col,
        text_cols=tuple(c.strip() for c in a.text_cols.split(",") if c.strip()),
        interactions=a.interactions,
        user_col=a.user_col,
        item_col=a.item_col,
        time_col=a.time_col,
        rating_col=a.rating_col,
        sequences=a.sequences,
        seq_user_col=a.seq_user_col,
        seq_items_col=a.seq_items_col,
    )
    return sources.custom(spec)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)

    def job() -> dict:
        try:
            thresholds = tuple(float(x) for x in a.rating_thresholds.split(",") if x.strip())
        except ValueError as e:
            raise InputError(f"--rating-thresholds: {e}") from e
        cfg = cli.from_args(a, PrepareConfig, rating_thresholds=thresholds)
        storage.check_writable(a.out)  # fail before reading anything when --out is unusable
        log.info("reading %s", a.dataset)
        return prepare(source_from_args(a), a.out, cfg, a.online_events)

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
