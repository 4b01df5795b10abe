"""Raw data sources: built-in datasets and bring-your-own files, read into one normal form.

Every source becomes two polars LazyFrames:

- items:        ``item_id:int64, text:str`` plus the source's extra columns;
- interactions: ``user_id:int64, item_id:int64, ts:int64, rating:float64 (null if unknown),
                row:int64`` where ``row`` is the order in the source (ties in ``ts`` keep it).

This module knows file formats and column names; it knows nothing about splits, negatives or
where the output goes (that is ``prepare_data``). Each problem with an input raises
``InputError`` naming the file, the column and how many rows are affected.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import os
import shutil
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from artifacts import storage
from models.errors import InputError

BUILTIN = ("ml-latest-small", "amazon-videogames-2018")

ML_SMALL_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
# sha256 of the published files (../shared/data/README.md); a download is checked against them.
ML_SMALL_SHA256 = {
    "ratings.csv": "80da8b3393dae325bbba5a31f291a6ba55d8d4f4396de3c456f2c1635b1b70e8",
    "movies.csv": "c47b783f23eb304413307e1bb05335e427737da20ec8d3c0e96335567dd5f3dc",
    "tags.csv": "68eec00a0820c2faa8863a6df7032f13d5899a4462bce9a97213905297ff3d34",
    "links.csv": "028a4a1d17751ca9276e0e0718cfc22356350f224a996e1ec348c23274b9209d",
}


@dataclass(frozen=True)
class Source:
    """A dataset in normal form, ready for ``prepare_data``."""

    name: str
    items: pl.LazyFrame
    interactions: pl.LazyFrame
    ts_kind: str  # "unix_seconds" | "ordinal" (position in the user's sequence)
    description: str
    items_file: str  # where the catalog came from, for error messages and provenance
    interactions_file: str
    extra_files: tuple[str, ...] = field(default=())


# ----------------------------------------------------------------------------- file reading


def check_utf8(path: str, label: str) -> None:
    """Raise InputError if ``path`` is not valid UTF-8, with the count and first bad line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        try:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
            return
        except UnicodeDecodeError:
            pass
    bad, first = 0, None
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                bad += 1
                first = first or lineno
    raise InputError(f"{label}: {bad} line(s) are not valid UTF-8 (first at line {first})")


def _format_of(uri: str) -> str:
    lower = uri.lower()
    for ext in ("parquet", "csv", "tsv"):
        if lower.endswith("." + ext):
            return ext
    raise InputError(f"{uri}: unknown file type (expected .csv, .tsv or .parquet)")


@contextlib.contextmanager
def scan_table(uri: str) -> Iterator[pl.LazyFrame]:
    """A LazyFrame over a csv/tsv/parquet file at a local or remote URI (all columns as read)."""
    fmt = _format_of(uri)
    with storage.local_copy(uri) as path:
        if fmt == "parquet":
            yield pl.scan_parquet(path)
            return
        check_utf8(path, uri)
        try:
            if fmt == "csv":
                yield pl.scan_csv(path, infer_schema_length=10_000)
            else:
                yield pl.scan_csv(path, separator="\t", quote_char=None, infer_schema_length=10_000)
        except pl.exceptions.PolarsError as e:
            raise InputError(f"{uri}: cannot parse as {fmt}: {e}") from e


def require_columns(lf: pl.LazyFrame, columns: list[str], label: str) -> None:
    present = lf.collect_schema().names()
    missing = [c for c in columns if c not in present]
    if missing:
        raise InputError(
            f"{label}: missing column(s) {', '.join(missing)}; the file has {', '.join(present)}"
        )


def collect(lf: pl.LazyFrame, label: str) -> pl.DataFrame:
    """Collect with the streaming engine; parse errors become InputErrors naming the file."""
    try:
        return lf.collect(engine="streaming")
    except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError) as e:
        raise InputError(f"{label}: {e}") from e


# ----------------------------------------------------------------------------- shared transforms


def int_ids(df: pl.DataFrame, column: str, label: str) -> pl.DataFrame:
    """Cast an id column to int64; ids that are not integers get dense int64 ids in sorted order,
    and the original string is kept in ``<column>_external``."""
    nulls = df[column].null_count()
    if nulls:
        raise InputError(f"{label}: column {column} has {nulls} empty value(s)")
    dtype = df.schema[column]
    if dtype.is_integer():
        return df.with_columns(pl.col(column).cast(pl.Int64))
    as_str = df[column].cast(pl.String).str.strip_chars()
    ints = as_str.cast(pl.Int64, strict=False)
    if ints.null_count() == 0:
        return df.with_columns(ints.alias(column))
    keys = as_str.unique().sort()
    mapping = pl.DataFrame(
        {f"{column}_external": keys, column: pl.int_range(len(keys), eager=True)}
    )
    return (
        df.with_columns(as_str.alias(f"{column}_external"))
        .drop(column)
        .join(mapping.with_columns(pl.col(column).cast(pl.Int64)), on=f"{column}_external")
    )


def join_text(columns: list[str]) -> pl.Expr:
    """One text per row: the non-empty values of ``columns`` joined by ' | '."""
    parts = [pl.col(c).cast(pl.String).str.strip_chars() for c in columns]
    return (
        pl.concat_list(parts)
        .list.eval(pl.element().filter(pl.element().is_not_null() & (pl.element() != "")))
        .list.join(" | ")
        .alias("text")
    )


def content_hash(texts: pl.Series) -> pl.Series:
    """sha256 of each text (hex, first 32 chars): stable across polars versions and machines,
    which the incremental catalog encoder relies on."""
    return pl.Series(
        "content_hash",
        [hashlib.sha256(t.encode("utf-8")).hexdigest()[:32] for t in texts],
        dtype=pl.String,
    )


def sequences_to_rows(df: pl.DataFrame, user_col: str, items_col: str, label: str) -> pl.DataFrame:
    """The ``sequences.tsv`` form (user, space-separated item ids in order) as interaction rows
    with ``ts`` = position in the sequence."""
    bad = df.filter(pl.col(items_col).is_null() | (pl.col(items_col).str.strip_chars() == ""))
    if bad.height:
        raise InputError(f"{label}: column {items_col} is empty in {bad.height} row(s)")
    rows = (
        df.select(
            pl.col(user_col).alias("user_id"),
            pl.col(items_col).cast(pl.String).str.strip_chars().str.split(" ").alias("item_id"),
        )
        .with_columns(pl.int_ranges(pl.col("item_id").list.len()).alias("ts"))
        .explode(["item_id", "ts"])
        .filter(pl.col("item_id") != "")
        .with_columns(pl.col("ts").cast(pl.Int64), pl.lit(None, dtype=pl.Float64).alias("rating"))
    )
    return rows


# ----------------------------------------------------------------------------- built-in datasets


def data_dir(explicit: str | None) -> str | None:
    """The data directory: --data-dir, else $KVRANK_DATA_DIR, else ../shared/data if present."""
    if explicit:
        return explicit
    if os.environ.get("KVRANK_DATA_DIR"):
        return os.environ["KVRANK_DATA_DIR"]
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return str(candidate)
    return None


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "kvrank"


def download_ml_small() -> str:
    """Download ml-latest-small into the user cache (once) and check every file's sha256."""
    target = cache_dir() / "ml-latest-small"
    if all((target / n).exists() for n in ML_SMALL_SHA256):
        return str(target)
    url = os.environ.get("KVRANK_ML_SMALL_URL", ML_SMALL_URL)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            payload = resp.read()
    except OSError as e:
        raise storage.StorageError(f"cannot download ml-latest-small from {url}: {e}") from e
    with zipfile.ZipFile(io.BytesIO(payload)) as zf:
        files = {Path(n).name: zf.read(n) for n in zf.namelist() if Path(n).name in ML_SMALL_SHA256}
    for name, expected in ML_SMALL_SHA256.items():
        got = hashlib.sha256(files.get(name, b"")).hexdigest()
        if got != expected:
            raise InputError(f"{url}: {name} has sha256 {got}, expected {expected}")
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)  # a partial copy left by an interrupted run
    staging.replace(target)
    return str(target)


def builtin_dir(name: str, data_dir_arg: str | None) -> str:
    root = data_dir(data_dir_arg)
    if root is not None:
        folder = storage.join(root, name)
        marker = "ratings.csv" if name == "ml-latest-small" else "sequences.tsv"
        if storage.exists(storage.join(folder, marker)):
            return folder
        if data_dir_arg or os.environ.get("KVRANK_DATA_DIR"):
            raise InputError(f"dataset {name} not found in data directory {root}")
    if name == "ml-latest-small":
        return download_ml_small()
    raise InputError(
        f"dataset {name} needs a data directory (--data-dir or $KVRANK_DATA_DIR) that holds "
        f"{name}/; only ml-latest-small can be downloaded"
    )


def movielens(folder: str) -> Source:
    """MovieLens latest-small: text = title | genres | up to 10 most frequent user tags."""
    ratings_uri, movies_uri = (
        storage.join(folder, "ratings.csv"),
        storage.join(folder, "movies.csv"),
    )
    tags_uri = storage.join(folder, "tags.csv")
    with scan_table(movies_uri) as movies_lf, scan_table(ratings_uri) as ratings_lf:
        require_columns(movies_lf, ["movieId", "title", "genres"], movies_uri)
        require_columns(ratings_lf, ["userId", "movieId", "rating", "timestamp"], ratings_uri)
        movies = collect(movies_lf, movies_uri)
        ratings = collect(ratings_lf.with_row_index("row"), ratings_uri)
    tags = pl.DataFrame(
        {"movieId": [], "tags": []}, schema={"movieId": pl.Int64, "tags": pl.String}
    )
    if storage.exists(tags_uri):
        with scan_table(tags_uri) as tags_lf:
            tags = collect(
                tags_lf.with_columns(pl.col("tag").cast(pl.String).str.to_lowercase())
                .group_by("movieId", "tag")
                .len()
                .sort(["movieId", "len", "tag"], descending=[False, True, False])
                .group_by("movieId", maintain_order=True)
                .agg(pl.col("tag").head(10).str.join(", ").alias("tags")),
                tags_uri,
            ).with_columns(pl.col("movieId").cast(pl.Int64))
    genres = pl.col("genres").str.replace_all(r"\|", ", ").replace("(no genres listed)", None)
    items = (
        movies.with_columns(pl.col("movieId").cast(pl.Int64))
        .join(tags, on="movieId", how="left")
        .with_columns(genres.alias("genre_text"), ("tags: " + pl.col("tags")).alias("tag_text"))
        .with_columns(join_text(["title", "genre_text", "tag_text"]))
        .select(pl.col("movieId").alias("item_id"), "text", "title", "genres")
    )
    interactions = ratings.select(
        pl.col("userId").cast(pl.Int64).alias("user_id"),
        pl.col("movieId").cast(pl.Int64).alias("item_id"),
        pl.col("timestamp").cast(pl.Int64).alias("ts"),
        pl.col("rating").cast(pl.Float64),
        pl.col("row").cast(pl.Int64),
    )
    return Source(
        name="ml-latest-small",
        items=items.lazy(),
        interactions=interactions.lazy(),
        ts_kind="unix_seconds",
        description="MovieLens latest-small (GroupLens); ratings 0.5-5 stars",
        items_file=movies_uri,
        interactions_file=ratings_uri,
        extra_files=(tags_uri,),
    )


def amazon_videogames(folder: str) -> Source:
    """Amazon Video Games 2018 5-core: text = product title; order only, no ratings."""
    items_uri, seq_uri = storage.join(folder, "items.tsv"), storage.join(folder, "sequences.tsv")
    with scan_table(items_uri) as items_lf, scan_table(seq_uri) as seq_lf:
        require_columns(items_lf, ["item_id", "asin", "title"], items_uri)
        require_columns(seq_lf, ["user_id", "item_ids"], seq_uri)
        items = collect(items_lf, items_uri)
        seqs = collect(seq_lf.select("user_id", pl.col("item_ids").cast(pl.String)), seq_uri)
    rows = sequences_to_rows(seqs, "user_id", "item_ids", seq_uri).with_columns(
        pl.col("item_id").cast(pl.Int64), pl.col("user_id").cast(pl.Int64)
    )
    items = items.with_columns(pl.col("item_id").cast(pl.Int64), join_text(["title"]))
    return Source(
        name="amazon-videogames-2018",
        items=items.lazy(),
        interactions=rows.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64)).lazy(),
        ts_kind="ordinal",
        description="Amazon Review Data 2018, Video Games 5-core (Ni et al. 2019); implicit",
        items_file=items_uri,
        interactions_file=seq_uri,
    )


def builtin(name: str, data_dir_arg: str | None) -> Source:
    if name not in BUILTIN:
        raise InputError(
            f"unknown dataset {name!r}: built-in datasets are {', '.join(BUILTIN)}; "
            "for your own data pass --items and --interactions or --sequences"
        )
    folder = builtin_dir(name, data_dir_arg)
    return movielens(folder) if name == "ml-latest-small" else amazon_videogames(folder)


# ----------------------------------------------------------------------------- bring your own


@dataclass(frozen=True)
class CustomSpec:
    """Where a user's own catalog and log are, and which columns mean what."""

    name: str
    items: str
    item_id_col: str = "item_id"
    text_cols: tuple[str, ...] = ("title",)
    interactions: str | None = None  # rows: user, item, timestamp, optional rating
    user_col: str = "user_id"
    item_col: str = "item_id"
    time_col: str = "timestamp"
    rating_col: str | None = None
    sequences: str | None = None  # one row per user: user id, space-separated item ids in order
    seq_user_col: str = "user_id"
    seq_items_col: str = "item_ids"

    def __post_init__(self) -> None:
        if (self.interactions is None) == (self.sequences is None):
            raise InputError("give exactly one of --interactions (rows) or --sequences")
        if not self.text_cols:
            raise InputError("--text-cols needs at least one column")


def custom(spec: CustomSpec) -> Source:
    with scan_table(spec.items) as lf:
        require_columns(lf, [spec.item_id_col, *spec.text_cols], spec.items)
        raw_items = collect(lf, spec.items)
    raw_items = (
        raw_items.rename({spec.item_id_col: "item_id"})
        if spec.item_id_col != "item_id"
        else raw_items
    )
    items = int_ids(raw_items, "item_id", f"{spec.items} ({spec.item_id_col})")
    items = items.with_columns(join_text(list(spec.text_cols)))
    external = "item_id_external" in items.columns

    if spec.sequences is not None:
        with scan_table(spec.sequences) as lf:
            require_columns(lf, [spec.seq_user_col, spec.seq_items_col], spec.sequences)
            seqs = collect(
                lf.with_columns(pl.col(spec.seq_items_col).cast(pl.String)), spec.sequences
            )
        rows = sequences_to_rows(seqs, spec.seq_user_col, spec.seq_items_col, spec.sequences)
        label, item_label, ts_kind = spec.sequences, spec.seq_items_col, "ordinal"
    else:
        cols = [spec.user_col, spec.item_col, spec.time_col] + (
            [spec.rating_col] if spec.rating_col else []
        )
        with scan_table(spec.interactions) as lf:
            require_columns(lf, cols, spec.interactions)
            raw = collect(lf.select(cols), spec.interactions)
        rating = (
            pl.col(spec.rating_col).cast(pl.Float64, strict=False)
            if spec.rating_col
            else pl.lit(None, pl.Float64)
        )
        rows = raw.select(
            pl.col(spec.user_col).alias("user_id"),
            pl.col(spec.item_col).alias("item_id"),
            pl.col(spec.time_col).alias("ts"),
            rating.alias("rating"),
        )
        label, item_label, ts_kind = spec.interactions, spec.item_col, "as_given"
        bad_ts = rows["ts"].cast(pl.Int64, strict=False).null_count()
        if bad_ts:
            raise InputError(
                f"{label}: column {spec.time_col} has {bad_ts} value(s) that are not integers"
            )
        rows = rows.with_columns(pl.col("ts").cast(pl.Int64, strict=False))

    rows = int_ids(
        rows,
        "user_id",
        f"{label} ({spec.user_col if spec.sequences is None else spec.seq_user_col})",
    )
    if external:
        rows = rows.with_columns(pl.col("item_id").cast(pl.String).str.strip_chars())
        rows = rows.rename({"item_id": "item_id_external"}).join(
            items.select("item_id_external", "item_id"), on="item_id_external", how="left"
        )
        unknown = rows.filter(pl.col("item_id").is_null())
        if unknown.height:
            examples = unknown["item_id_external"].unique().head(5).to_list()
            raise InputError(
                f"{label}: column {item_label} names {unknown.height} interaction(s) with items "
                f"not in {spec.items} (e.g. {examples})"
            )
        rows = rows.drop("item_id_external")
    else:
        ints = rows["item_id"].cast(pl.String).str.strip_chars().cast(pl.Int64, strict=False)
        if ints.null_count():
            raise InputError(
                f"{label}: column {item_label} has {ints.null_count()} value(s) "
                "that are not item ids"
            )
        rows = rows.with_columns(ints.alias("item_id"))
    rows = rows.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    return Source(
        name=spec.name,
        items=items.lazy(),
        interactions=rows.select("user_id", "item_id", "ts", "rating", "row").lazy(),
        ts_kind=ts_kind,
        description=f"custom: items {spec.items}, interactions {label}",
        items_file=spec.items,
        interactions_file=label,
    )
