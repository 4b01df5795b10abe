"""Published datasets, item vectors and ranker checkpoints, read into the forms the models use
(vid space).

No Ray here: the jobs wrap these readers in Ray Data where the work is distributed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from artifacts import storage
from models.config import EncoderConfig
from models.errors import InputError


def read_dataset_table(dataset_uri: str, name: str) -> pl.DataFrame:
    storage.read_marker(dataset_uri)
    return pl.from_arrow(storage.read_table(dataset_uri, f"{name}.parquet"))


def user_sequences(dataset_uri: str) -> pl.DataFrame:
    """One row per split user, every item as a vid:
    user_id, hist (list[int]), hist_fb (list[int]), valid, valid_fb, test, test_fb, negatives."""
    items = read_dataset_table(dataset_uri, "items").select("item_id", "vid")
    splits = read_dataset_table(dataset_uri, "splits")
    lut = dict(zip(items["item_id"].to_list(), items["vid"].to_list(), strict=True))

    def to_vid(col: str) -> pl.Expr:
        return pl.col(col).replace_strict(lut, return_dtype=pl.Int64)

    def list_to_vid(col: str) -> pl.Expr:
        return (
            pl.col(col)
            .cast(pl.List(pl.Int64))
            .list.eval(pl.element().replace_strict(lut, return_dtype=pl.Int64))
        )

    return splits.select(
        "user_id",
        list_to_vid("history").alias("hist"),
        pl.col("history_feedback").cast(pl.List(pl.Int64)).alias("hist_fb"),
        to_vid("valid_item").alias("valid"),
        pl.col("valid_feedback").cast(pl.Int64).alias("valid_fb"),
        to_vid("test_item").alias("test"),
        pl.col("test_feedback").cast(pl.Int64).alias("test_fb"),
        list_to_vid("negatives").alias("negatives"),
    )


def held_out_vids(dataset_uri: str) -> np.ndarray:
    """The vids of a dataset's held-out (new) items (``prepare_data --holdout-items``), sorted;
    empty for a dataset without them. Training never draws one as a negative or scores one in
    its catalog softmax; evaluate reports the users whose test item is one of them."""
    marker = storage.read_marker(dataset_uri)
    if not marker.get("held_out_items"):
        return np.zeros(0, dtype=np.int64)
    held = pl.from_arrow(storage.read_table(dataset_uri, "held_out.parquet", marker=marker))
    items = read_dataset_table(dataset_uri, "items").select("item_id", "vid")
    vids = items.join(held, on="item_id", how="semi")["vid"].to_numpy().astype(np.int64)
    return np.sort(vids)


def negative_pool(held_out: np.ndarray, n_items: int) -> np.ndarray | None:
    """The vids a training job draws negatives from: the catalog without ``held_out`` (None:
    the whole catalog, drawn without a lookup)."""
    return np.setdiff1d(np.arange(n_items), held_out) if len(held_out) else None


def item_titles(dataset_uri: str) -> list[str]:
    """Each item's title by vid (the text the teacher reads); ``text`` where a catalog has no
    title column."""
    items = read_dataset_table(dataset_uri, "items")
    col = "title" if "title" in items.columns else "text"
    items = items.sort("vid")
    if items.height and items["vid"].to_list() != list(range(items.height)):
        raise InputError(f"{dataset_uri}: items.vid is not 0..{items.height - 1}")
    return items[col].fill_null("").to_list()


def training_windows(seqs: pl.DataFrame, max_len: int) -> pl.DataFrame:
    """Each user's history cut from its end into windows of ``max_len + 1`` items (consecutive
    windows share one item, so every item after the first is a next-item target once): the rows
    of a training epoch. A window shorter than 2 items (the oldest rest) is dropped.
    Columns: user_id, hist, hist_fb (the window)."""
    span = max_len + 1
    n = seqs["hist"].list.len()
    ends = [list(range(int(k), 1, -max_len)) for k in n.to_list()]
    rows = (
        seqs.select("user_id", "hist", "hist_fb")
        .with_columns(pl.Series("end", ends, dtype=pl.List(pl.Int64)))
        .explode("end")
        .drop_nulls("end")
        .with_columns(start=(pl.col("end") - span).clip(lower_bound=0))
    )
    length = pl.col("end") - pl.col("start")
    return rows.select(
        "user_id",
        pl.col("hist").list.slice(pl.col("start"), length),
        pl.col("hist_fb").list.slice(pl.col("start"), length),
    )


def encoder_tag(cfg: EncoderConfig, engine: str = "hf") -> str:
    """A folder name for the vectors of this encoder: model name (+ the engine, when not hf)
    + hash of its config."""
    from models.encoder import default_model_dir

    name = os.path.basename(os.path.normpath(cfg.model_dir or default_model_dir()))
    name = "minilm-l6-v2" if cfg.model_dir is None else re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    digest = hashlib.sha256(cfg.to_json().encode()).hexdigest()[:8]
    return f"{name}-{digest}" if engine == "hf" else f"{name}-{engine}-{digest}"


def vectors_uri(out: str, dataset: str, encoder_tag: str) -> str:
    """Item vectors of one dataset's catalog by one encoder."""
    return storage.join(out, "item_vectors", dataset, encoder_tag)


def default_vectors_uri(out: str, dataset: str) -> str:
    """Where ``encode_items`` with its default encoder publishes ``dataset``'s vectors under
    ``out``: what a job reads when no ``--vectors-uri`` is given."""
    return vectors_uri(out, dataset, encoder_tag(EncoderConfig()))


def item_table(vectors_dir: str, n_items: int) -> tuple[torch.Tensor, int]:
    """The (n_items, dim) float32 table by vid from a published item_vectors folder; items
    without a vector (skipped by the encoder) get zeros. Returns (table, missing count)."""
    marker = storage.read_marker(vectors_dir)
    t = storage.read_table(vectors_dir, "vectors.parquet", ["vid", "vector"], marker)
    dim = int(marker["dim"])
    vids = t.column("vid").to_numpy()
    if len(vids) and int(vids.max()) >= n_items:
        raise InputError(
            f"{vectors_dir}: vid {int(vids.max())} is outside the catalog of {n_items}"
        )
    flat = t.column("vector").combine_chunks().values.to_numpy(zero_copy_only=False)
    table = np.zeros((n_items, dim), dtype=np.float32)
    table[vids] = flat.reshape(len(vids), dim).astype(np.float32)
    return torch.from_numpy(table), n_items - len(vids)


def blocks(table: pa.Table, n: int) -> list[pa.Table]:
    """``table`` cut into up to ``n`` contiguous slices: Ray Data blocks that an actor pool can
    share out without a repartition task (which would need a CPU the actors already hold)."""
    step = max(1, -(-table.num_rows // max(1, n)))
    return [table.slice(i, step) for i in range(0, table.num_rows, step)]


def load_checkpoint(uri: str):
    """(Ranker with weights, its marker) from a published checkpoint folder; the caller sets the
    item table for text inputs."""
    from models.config import RankerConfig
    from models.ranker import Ranker

    marker = storage.read_marker(uri)
    rc = RankerConfig.from_json(storage.read_file(uri, "ranker.json").decode())
    model = Ranker(rc, n_items=int(marker["n_items"]))
    state = torch.load(
        io.BytesIO(storage.read_file(uri, "model.pt")),
        map_location="cpu",
        weights_only=True,
    )
    model.load_state_dict(state)
    return model.eval(), marker


def load_ranker(checkpoint: str, vectors_uri: str | None = None):
    """(Ranker ready to score, checkpoint marker, max history length it was trained with): the
    item table comes from ``vectors_uri`` or, by default, the vectors it was trained on."""
    model, marker = load_checkpoint(checkpoint)
    train_cfg = json.loads(storage.read_file(checkpoint, "train.json"))
    if model.cfg.reads_vectors:
        table, _ = item_table(vectors_uri or marker["vectors_uri"], int(marker["n_items"]))
        model.set_item_table(table)
    return model, marker, int(train_cfg["max_len"])
