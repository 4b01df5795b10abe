"""A tiny synthetic catalog and users for the job tests, and a helper to run a job's main()."""

from __future__ import annotations

import json

import numpy as np
import polars as pl

from pipelines import prepare_data

GENRES = ["space opera", "cooking show", "jazz album", "chess manual", "garden tools"]
N_ITEMS, N_USERS = 60, 40


def write_catalog(folder, texts: dict[int, str]) -> str:
    path = folder / "items.csv"
    pl.DataFrame({"item_id": list(texts), "title": list(texts.values())}).write_csv(path)
    return str(path)


def base_texts() -> dict[int, str]:
    return {i: f"{GENRES[i % 5]} number {i}" for i in range(N_ITEMS)}


def write_sequences(folder) -> str:
    """Each user walks through one genre in order: the next item is predictable."""
    rng = np.random.default_rng(0)
    rows = []
    for u in range(N_USERS):
        g = u % 5
        genre_items = [i for i in range(N_ITEMS) if i % 5 == g]
        start = int(rng.integers(0, 4))
        rows.append({"user_id": u, "item_ids": " ".join(map(str, genre_items[start : start + 7]))})
    path = folder / "seq.tsv"
    pl.DataFrame(rows).write_csv(path, separator="\t")
    return str(path)


def prepare(folder, out: str, items_csv: str, seq: str) -> str:
    rc = prepare_data.main(
        [
            "--dataset",
            "tiny",
            "--items",
            items_csv,
            "--sequences",
            seq,
            "--negatives",
            "10",
            "--out",
            out,
        ]
    )
    assert rc == 0
    return prepare_data.dataset_uri(out, "tiny")


def run_json(capsys, main, args: list[str]) -> dict:
    capsys.readouterr()
    rc = main(args)
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    return json.loads(captured.out.strip().splitlines()[-1])


# a CPU-second ranker: its shape, and training options for train_ranker and train_kv_pool
TINY_MODEL = ["--d-model", "32", "--n-heads", "2", "--n-kv-heads", "2", "--head-dim", "16"]
TINY_MODEL += ["--ffn-dim", "64"]
TINY_TRAIN = ["--batch-size", "8", "--cuts", "2", "--negatives", "5", "--val-users", "8"]
TINY_TRAIN += ["--max-len", "10"]
TINY_SHAPE = TINY_MODEL + TINY_TRAIN


# a teacher of a few CPU-seconds for train_teacher: head size 64 (what vLLM's CPU attention
# takes), short prompts
TINY_TEACHER = ["--d-model", "64", "--n-heads", "1", "--ffn-dim", "64", "--max-length", "96"]
TINY_TEACHER += ["--max-history", "5", "--batch-size", "4", "--negatives", "3", "--val-users", "8"]
TINY_TEACHER += ["--max-len", "10", "--max-steps", "3"]


def tiny_chain(ds: str, out: str, actors: int = 1) -> dict:
    """On the tiny dataset ``ds``: train a one-epoch tiny id ranker (run "base"), fit its
    CollectiveKV pools (run "ckv", M 16) and build every user's state, all under ``out``:
    {"base", "fit", "states"}, the jobs' summaries (``states["user_states"]`` is the manifest
    URI)."""
    from models.config import CollectiveKVConfig
    from pipelines import build_user_states, train_kv_pool, train_ranker
    from pipelines.common import ranker_training

    args = train_ranker.build_parser().parse_args(
        ["--dataset-uri", ds, "--out", out, "--item-input", "id", "--epochs", "1", *TINY_SHAPE]
    )
    rc, tc = train_ranker.configs_from_args(args, 5)
    base = ranker_training.train(ds, None, out, "base", rc, tc)
    fit = train_kv_pool.fit(
        ds,
        base["checkpoint"],
        out,
        run="ckv",
        ckv=CollectiveKVConfig(pool_size=16),
        tc=tc,
        init_users=40,
        init_tokens=200,
    )
    states = build_user_states.build(ds, fit["checkpoint"], out, actors=actors)
    return {"base": base, "fit": fit, "states": states}
