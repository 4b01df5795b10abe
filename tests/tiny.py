"""A tiny synthetic catalog and users for the job tests, and a helper to run a job's main()."""

from __future__ import annotations

import contextlib
import json
import logging

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


def main_json(main, args: list[str]) -> dict:
    """A job's ``main(args)`` run outside a test (in a fixture): its one-line JSON summary."""
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(args)
    assert rc == 0, f"{main.__module__} {args} exited {rc}"
    return json.loads(buf.getvalue().strip().splitlines()[-1])


# train_kv_pool's options in the tiny chain: the pool size automatic (16 for 100 tokens), d_u 2,
# a two-step fine-tune of the cache alone, distilled from the base
TINY_FIT = ["--run", "ckv", "--user-dim", "2", "--init-tokens", "100", "--epochs", "1"]
TINY_FIT += ["--max-steps", "2", *TINY_TRAIN, "--base-distill-weight", "1", "--tune", "kv"]


@contextlib.contextmanager
def logged_warnings(logger: str):
    """The messages ``logger`` warns (or worse) while the block runs, as a list."""
    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger(logger).addHandler(catch)
    try:
        yield warned
    finally:
        logging.getLogger(logger).removeHandler(catch)


def tiny_chain(ds: str, out: str) -> dict:
    """On the tiny dataset ``ds``: train a one-epoch tiny id ranker (run "base"), fit its
    CollectiveKV pools (train_kv_pool's command line, ``TINY_FIT``) and build every user's
    state, all under ``out``: {"base", "fit", "states"}, the jobs' summaries
    (``states["user_states"]`` is the manifest URI), and "fit_warnings", what train_kv_pool
    logged as warnings."""
    from pipelines import build_user_states, train_kv_pool, train_ranker
    from pipelines.common import ranker_training

    args = train_ranker.build_parser().parse_args(
        ["--dataset-uri", ds, "--out", out, "--item-input", "id", "--epochs", "1", *TINY_SHAPE]
    )
    rc, tc = train_ranker.configs_from_args(args, 5)
    base = ranker_training.train(ds, None, out, "base", rc, tc)
    common = ["--dataset-uri", ds, "--out", out]
    with logged_warnings("kvrank.train_kv_pool") as warned:
        fit = main_json(
            train_kv_pool.main, [*common, "--checkpoint", base["checkpoint"], *TINY_FIT]
        )
    states = main_json(
        build_user_states.main, [*common, "--checkpoint", fit["checkpoint"], "--actors", "1"]
    )
    return {"base": base, "fit": fit, "states": states, "fit_warnings": warned}


def untrained_ranker(ds: str, out: str) -> str:
    """A tiny id ranker on the tiny dataset ``ds`` that was never trained (seeded weights),
    published as train_ranker publishes one, under ``out``: for tests that read a checkpoint but
    do not depend on what the ranker learnt. Its URI."""
    import dataclasses
    import io

    import torch

    from artifacts import storage
    from models.ranker import Ranker
    from pipelines import train_ranker

    args = train_ranker.build_parser().parse_args(
        ["--dataset-uri", ds, "--out", out, "--item-input", "id", *TINY_SHAPE]
    )
    rc, tc = train_ranker.configs_from_args(args, 5)
    n_items = int(storage.read_marker(ds)["items"])
    torch.manual_seed(0)
    buf = io.BytesIO()
    torch.save(Ranker(rc, n_items=n_items).state_dict(), buf)
    root = storage.join(out, "checkpoints", "untrained")
    pub = storage.Publication(root)
    pub.put_bytes("model.pt", buf.getvalue())
    pub.put_bytes("ranker.json", rc.to_json().encode())
    pub.put_bytes("train.json", json.dumps(dataclasses.asdict(tc)).encode())
    pub.publish(
        {"kind": "ranker_checkpoint", "dataset_uri": storage.pinned(ds), "n_items": n_items}
    )
    return root


def untrained_teacher(ds: str, out: str) -> str:
    """A causal teacher of ``TINY_TEACHER``'s shape that was never trained (seeded weights),
    published as train_teacher publishes one, under ``out``: for tests that compare the
    teacher's engines, not what it learnt. Its URI."""
    import torch

    from artifacts import storage
    from models.teacher import build_teacher
    from pipelines import train_teacher

    args = train_teacher.build_parser().parse_args(
        ["--dataset-uri", ds, "--out", out, *TINY_TEACHER]
    )
    mc, tc = train_teacher.configs_from_args(args)
    torch.manual_seed(0)
    root = train_teacher.teacher_uri(out, "untrained")
    marker = {"dataset_uri": storage.pinned(ds), "dataset": storage.read_marker(ds)["name"]}
    train_teacher.publish_teacher(root, build_teacher(mc), mc, tc, [], marker)
    return root
