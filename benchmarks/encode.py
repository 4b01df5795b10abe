"""Catalog encoding throughput: ``pipelines.encode_items`` (Ray Data actor pool) against a plain
single-process loop over the same encoder and batches, then the incremental run after 1% of the
item texts change.

    python -m benchmarks.encode [--dataset ml-latest-small] [--edit-share 0.01]
                                [--out benchmarks/results/encode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import polars as pl
import torch

from artifacts import storage
from benchmarks import report as report_file
from models.config import EncoderConfig
from models.encoder import ItemEncoder
from pipelines import encode_items, prepare_data
from pipelines.common import sources


def plain_loop(texts: list[str], cfg: EncoderConfig) -> float:
    """Seconds to encode ``texts`` in one process, same order and batch size as the job."""
    torch.set_num_threads(os.cpu_count() or 1)
    enc = ItemEncoder(cfg)
    order = np.argsort([len(t) for t in texts], kind="stable")
    ordered = [texts[i] for i in order]
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(ordered), cfg.batch_size):
            enc(enc.tokenize(ordered[i : i + cfg.batch_size]))
    return time.perf_counter() - t0


def edit_catalog(dataset_uri: str, share: float, seed: int) -> int:
    """Change the text of ``share`` of the items in a published dataset; returns how many."""
    tables = prepare_data.load_dataset(dataset_uri)
    items = tables["items"]
    n = max(1, int(round(share * items.height)))
    rows = np.random.default_rng(seed).choice(items.height, size=n, replace=False)
    edited = pl.Series(np.isin(np.arange(items.height), rows))
    text = pl.when(edited).then(pl.col("text") + " (edited)").otherwise(pl.col("text"))
    items = items.with_columns(text.alias("text"))
    items = items.with_columns(sources.content_hash(items["text"]))
    pub = storage.Publication(dataset_uri)
    for name, t in (
        ("items", items),
        ("interactions", tables["interactions"]),
        ("splits", tables["splits"]),
    ):
        pub.put_table(f"{name}.parquet", t.to_arrow())
    pub.publish(storage.read_marker(dataset_uri) | {"edited_items": n})
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="ml-latest-small")
    p.add_argument("--edit-share", type=float, default=0.01)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/encode.json")
    a = p.parse_args()
    cfg = EncoderConfig()
    with tempfile.TemporaryDirectory() as root:
        src = sources.builtin(a.dataset, None)
        summary = prepare_data.prepare(src, root, prepare_data.PrepareConfig())
        ds = summary["out"]
        texts = prepare_data.load_dataset(ds)["items"]["text"].to_list()
        print(f"plain loop over {len(texts)} items...", file=sys.stderr)
        loop_s = plain_loop(texts, cfg)
        print(f"encode_items, first run ({a.actors} actors)...", file=sys.stderr)
        first = encode_items.encode_items(ds, root, cfg, actors=a.actors)
        edited = edit_catalog(ds, a.edit_share, seed=0)
        print(f"encode_items after editing {edited} texts...", file=sys.stderr)
        second = encode_items.encode_items(ds, root, cfg, actors=a.actors)
    report = {
        "benchmark": "encode",
        "dataset": a.dataset,
        "machine": report_file.machine(),
        "items": len(texts),
        "batch_size": cfg.batch_size,
        "plain_loop": {
            "seconds": round(loop_s, 2),
            "items_per_second": round(len(texts) / loop_s, 1),
        },
        "encode_items_first": {
            "actors": a.actors,
            "job_seconds": first["seconds"],
            "encode_seconds": first["encode_seconds"],
            "items_per_second_encode": first["items_per_second"],
            "items_per_second_job": round(len(texts) / first["seconds"], 1),
        },
        "encode_items_incremental": {
            "edited_items": edited,
            "encoded": second["encoded"],
            "reused": second["reused"],
            "job_seconds": second["seconds"],
            "share_of_first_run_time": round(second["seconds"] / first["seconds"], 3),
        },
        "speedup_job_over_plain_loop": round(loop_s / first["seconds"], 2),
    }
    report_file.write(a.out, report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
