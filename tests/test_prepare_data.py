"""pipelines.prepare_data on the built-in datasets and on bring-your-own data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from pipelines import prepare_data
from pipelines.common import sources
from pipelines.prepare_data import PrepareConfig, load_dataset, sample_negatives


def run_job(capsys, *args: str) -> dict:
    """Run the job's CLI in-process; returns its one-line JSON summary (the last stdout line)."""
    rc = prepare_data.main(list(args))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def check_splits(ds: dict[str, pl.DataFrame], negatives: int) -> None:
    """Leave-one-out invariants: history + valid + test is the user's log in order, and the
    negatives are distinct items from the catalog that the user never touched."""
    inter = ds["interactions"].group_by("user_id", maintain_order=True).agg("item_id")
    joined = ds["splits"].join(inter, on="user_id")
    catalog = set(ds["items"]["item_id"].to_list())
    for row in joined.iter_rows(named=True):
        assert row["history"] + [row["valid_item"], row["test_item"]] == row["item_id"]
        neg = row["negatives"]
        assert len(neg) == negatives == len(set(neg))
        assert not set(neg) & set(row["item_id"])
        assert set(neg) <= catalog


def test_movielens_counts_match_raw_files(tmp_path, data_dir, capsys):
    raw = os.path.join(data_dir, "ml-latest-small")
    ratings = pl.read_csv(os.path.join(raw, "ratings.csv"))
    movies = pl.read_csv(os.path.join(raw, "movies.csv"))
    summary = run_job(capsys, "--dataset", "ml-latest-small", "--out", str(tmp_path))
    assert summary["users"] == ratings["userId"].n_unique() == 610
    assert summary["interactions"] == ratings.height == 100_836
    assert summary["items"] == movies.height == 9_742
    assert summary["max_history_length"] == ratings.group_by("userId").len()["len"].max() - 2

    ds = load_dataset(summary["out"])
    items = ds["items"]
    assert items["vid"].to_list() == list(range(items.height))
    assert items["item_id"].is_sorted()
    toy = items.filter(pl.col("item_id") == 1).row(0, named=True)
    assert toy["text"].startswith("Toy Story (1995) | Adventure, Animation")
    assert "tags: " in toy["text"]  # the most frequent user tags join the text
    # feedback buckets: 0.5..1 -> 0, ..., 4.5..5 -> 4; no unknowns in MovieLens
    fb = ds["interactions"].join(
        ratings.select(
            pl.col("userId").alias("user_id"), pl.col("movieId").alias("item_id"), "rating"
        ),
        on=["user_id", "item_id"],
    )
    expected = (fb["rating"] >= 1.5).cast(pl.Int8) + (fb["rating"] >= 2.5).cast(pl.Int8)
    expected += (fb["rating"] >= 3.5).cast(pl.Int8) + (fb["rating"] >= 4.5).cast(pl.Int8)
    assert (fb["feedback"] == expected).all()
    assert ds["interactions"]["ts"].is_sorted() is False  # sorted per user, not globally
    per_user_sorted = ds["interactions"].group_by("user_id").agg(pl.col("ts").is_sorted())
    assert per_user_sorted["ts"].all()
    check_splits(ds, 100)


def test_amazon_counts_match_raw_files(tmp_path, data_dir, capsys):
    raw = os.path.join(data_dir, "amazon-videogames-2018")
    seqs = pl.read_csv(os.path.join(raw, "sequences.tsv"), separator="\t", quote_char=None)
    items = pl.read_csv(os.path.join(raw, "items.tsv"), separator="\t", quote_char=None)
    n_inter = seqs["item_ids"].str.split(" ").list.len().sum()
    summary = run_job(
        capsys,
        "--dataset",
        "amazon-videogames-2018",
        "--data-dir",
        data_dir,
        "--out",
        str(tmp_path),
    )
    assert (summary["users"], summary["items"], summary["interactions"]) == (
        seqs.height,
        items.height,
        n_inter,
    )
    assert (summary["users"], summary["items"], summary["interactions"]) == (
        50_546,
        16_859,
        452_989,
    )
    ds = load_dataset(summary["out"])
    assert (ds["interactions"]["feedback"] == -1).all()
    # the order of each user's sequence is kept: user 0 bought items 0..5 in that order
    u0 = ds["splits"].filter(pl.col("user_id") == 0).row(0, named=True)
    assert (u0["history"], u0["valid_item"], u0["test_item"]) == ([0, 1, 2, 3], 4, 5)


def test_negatives_do_not_depend_on_user_order():
    catalog = np.arange(0, 500, 5, dtype=np.int64)  # 100 items, non-contiguous ids
    users = np.array([7, 3, 11, 2**40 + 5])
    seen = [catalog[:10], catalog[50:90], catalog[::3], catalog[1:2]]
    a = sample_negatives(users, seen, catalog, k=20, seed=1)
    b = sample_negatives(users[::-1], seen[::-1], catalog, k=20, seed=1)[::-1]
    for x, y, s in zip(a, b, seen, strict=True):
        assert np.array_equal(x, y)
        assert len(set(x.tolist())) == 20 and not set(x.tolist()) & set(s.tolist())
    c = sample_negatives(users, seen, catalog, k=20, seed=2)
    assert any(not np.array_equal(x, z) for x, z in zip(a, c, strict=True))


def test_negatives_cover_the_whole_free_catalog():
    catalog = np.arange(10, dtype=np.int64)
    seen = [np.array([0, 3, 4, 9])]
    (neg,) = sample_negatives(np.array([1]), seen, catalog, k=6, seed=0)
    assert sorted(neg.tolist()) == [1, 2, 5, 6, 7, 8]


def test_same_seed_same_splits(tmp_path, data_dir, capsys):
    a = run_job(capsys, "--dataset", "ml-latest-small", "--out", str(tmp_path / "a"))
    b = run_job(capsys, "--dataset", "ml-latest-small", "--out", str(tmp_path / "b"))
    assert load_dataset(a["out"])["splits"].equals(load_dataset(b["out"])["splits"])


# ----------------------------------------------------------------------------- bring your own


@pytest.fixture()
def shop(tmp_path):
    """A tiny shop: string SKUs, two text columns, a rating log and the same log as sequences."""
    items = pl.DataFrame(
        {
            "sku": [f"S{i:03d}" for i in range(30)],
            "name": [f"Widget {i}" for i in range(30)],
            "brand": ["Acme" if i % 2 else None for i in range(30)],
        }
    )
    rows = []
    for u in range(4):
        for j in range(5 + u):
            rows.append(
                {
                    "uid": f"user-{u}",
                    "item": f"S{(u * 7 + j) % 30:03d}",
                    "t": 100 * j,
                    "stars": 1 + j % 5,
                }
            )
    log = pl.DataFrame(rows)
    seqs = log.group_by("uid", maintain_order=True).agg(pl.col("item").str.join(" ").alias("items"))
    paths = {
        "items_csv": tmp_path / "items.csv",
        "items_parquet": tmp_path / "items.parquet",
        "log_csv": tmp_path / "log.csv",
        "log_parquet": tmp_path / "log.parquet",
        "seq_tsv": tmp_path / "seq.tsv",
    }
    items.write_csv(paths["items_csv"])
    items.write_parquet(paths["items_parquet"])
    log.write_csv(paths["log_csv"])
    log.write_parquet(paths["log_parquet"])
    seqs.write_csv(paths["seq_tsv"], separator="\t")
    return {k: str(v) for k, v in paths.items()} | {"log": log, "items": items}


def byo_args(shop: dict, out: str, form: str) -> list[str]:
    args = [
        "--dataset",
        "shop",
        "--out",
        out,
        "--item-id-col",
        "sku",
        "--text-cols",
        "name,brand",
        "--negatives",
        "5",
    ]
    if form == "rows":
        args += [
            "--items",
            shop["items_csv"],
            "--interactions",
            shop["log_csv"],
            "--user-col",
            "uid",
            "--item-col",
            "item",
            "--time-col",
            "t",
            "--rating-col",
            "stars",
        ]
    elif form == "parquet":
        args += [
            "--items",
            shop["items_parquet"],
            "--interactions",
            shop["log_parquet"],
            "--user-col",
            "uid",
            "--item-col",
            "item",
            "--time-col",
            "t",
        ]
    else:
        args += [
            "--items",
            shop["items_csv"],
            "--sequences",
            shop["seq_tsv"],
            "--seq-user-col",
            "uid",
            "--seq-items-col",
            "items",
        ]
    return args


@pytest.mark.parametrize("form", ["rows", "parquet", "sequences"])
def test_bring_your_own_data(tmp_path, capsys, shop, form):
    summary = run_job(capsys, *byo_args(shop, str(tmp_path), form))
    log = shop["log"]
    assert (summary["users"], summary["items"], summary["interactions"]) == (4, 30, log.height)
    ds = load_dataset(summary["out"])
    items = ds["items"]
    # string SKUs get dense int ids in sorted order; the SKU is kept beside them
    assert items["item_id_external"].to_list() == sorted(shop["items"]["sku"].to_list())
    assert items.filter(pl.col("item_id_external") == "S001")["text"].item() == "Widget 1 | Acme"
    assert items.filter(pl.col("item_id_external") == "S000")["text"].item() == "Widget 0"
    sku_of = dict(zip(items["item_id"].to_list(), items["item_id_external"].to_list(), strict=True))
    got = [sku_of[i] for i in ds["interactions"]["item_id"].to_list()]
    expected = log.sort(["uid", "t"])["item"].to_list()  # user-0..3 sort the same as their int ids
    assert got == expected
    feedback = ds["interactions"]["feedback"]
    if form == "rows":
        assert feedback.to_list() == [s - 1 for s in log.sort(["uid", "t"])["stars"].to_list()]
    else:
        assert (feedback == -1).all()
    check_splits(ds, 5)


def test_cli_runs_as_a_module_and_prints_one_json_line(tmp_path, data_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.prepare_data",
            "--dataset",
            "ml-latest-small",
            "--data-dir",
            data_dir,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["users"] == 610 and summary["interactions"] == 100_836
    assert summary["seconds"] > 0
    assert "[4/4] publishing" in proc.stderr  # progress goes to stderr, the summary to stdout


def test_config_rejects_decreasing_thresholds():
    with pytest.raises(sources.InputError, match="increasing"):
        PrepareConfig(rating_thresholds=(3.0, 2.0))


def test_online_events_of_a_serving_store_join_the_next_dataset(tmp_path, capsys, store_uri):
    """Events a store acknowledged (in either engine) come back as interactions after each
    user's own, in the order they were applied - a known user's and a new user's - with the
    store's vids mapped back to item ids through the dataset its states were built from."""
    from artifacts import storage
    from artifacts.state_store import Write, open_store
    from tests import tiny

    seq = tiny.write_sequences(tmp_path)
    items_csv = tiny.write_catalog(tmp_path, tiny.base_texts())
    dataset = tiny.prepare(tmp_path, str(tmp_path / "served"), items_csv, seq)
    states_uri = str(tmp_path / "states")
    storage.Publication(states_uri).publish({"kind": "user_states", "dataset_uri": dataset})
    vid_of = dict(load_dataset(dataset)["items"].select("item_id", "vid").iter_rows())
    events = {3: [(10, 2), (15, 4)], 1000: [(1, 0), (6, 3), (11, 1)]}  # user -> (item, feedback)
    for shard in (0, 1):
        store = open_store(store_uri, shard)
        store.load([], meta={"states": storage.resolve(states_uri)})
        for user in (u for u in events if u % 2 == shard):
            for version, (item, fb) in enumerate(events[user]):
                store.commit([Write(user, version, b"s", vid_of[item], fb, None, {})])
        store.close()

    before = load_dataset(dataset)["interactions"]
    args = ["--dataset", "tiny", "--items", items_csv, "--sequences", seq, "--negatives", "10"]
    summary = run_job(capsys, *args, "--out", str(tmp_path / "next"), "--online-events", store_uri)
    assert summary["online_events"] == 5
    assert summary["interactions"] == before.height + 5
    after = load_dataset(summary["out"])
    for user, done in events.items():
        mine = after["interactions"].filter(pl.col("user_id") == user)
        old = before.filter(pl.col("user_id") == user)
        assert mine.head(old.height).equals(old)
        tail = mine.tail(len(done))
        assert list(zip(tail["item_id"], tail["feedback"], strict=True)) == done
        assert tail["ts"].is_sorted() and (old.height == 0 or tail["ts"][0] > old["ts"].max())
    new_user = after["splits"].filter(pl.col("user_id") == 1000)
    assert (new_user["history"].item().to_list(), new_user["test_item"].item()) == ([1], 11)
    check_splits(after, 10)

    bad = ["--rating-thresholds", "1.5,2.5,3.5"]  # 4 classes: feedback 4 is out of range
    rc = prepare_data.main(
        [*args, *bad, "--out", str(tmp_path / "x"), "--online-events", store_uri]
    )
    assert rc != 0 and "feedback up to 4" in capsys.readouterr().err


def test_held_out_items_are_only_ever_test_items(tmp_path, data_dir, capsys):
    from artifacts.data import held_out_vids, user_sequences

    args = ["--dataset", "ml-latest-small", "--holdout-items", "0.1"]
    s = run_job(capsys, *args, "--out", str(tmp_path / "a"))
    ds = load_dataset(s["out"])
    named = ds["interactions"]["item_id"].n_unique()  # held-out items stay as test items
    assert s["held_out_items"] == round(0.1 * 9_724) == 972
    held = held_out_vids(s["out"])
    assert len(held) == 972 and (np.diff(held) > 0).all()
    seqs = user_sequences(s["out"])
    # no history, validation item, nor any interaction but a user's last holds a held-out item
    assert not np.isin(np.concatenate(seqs["hist"].to_list()), held).any()
    assert not np.isin(seqs["valid"].to_numpy(), held).any()
    new = np.isin(seqs["test"].to_numpy(), held)
    assert new.sum() == s["new_item_test_users"] > 30
    last = ds["interactions"].group_by("user_id", maintain_order=True).agg(pl.col("item_id").last())
    vid = dict(zip(ds["items"]["item_id"], ds["items"]["vid"], strict=True))
    kept_held = ds["interactions"].filter(pl.col("item_id").replace_strict(vid).is_in(held))
    assert kept_held.height == new.sum() == kept_held.join(last, on=["user_id", "item_id"]).height
    assert named < 9_724  # held-out items nobody tested on leave the log
    check_splits(ds, 100)
    # the same seed holds out the same items; without the option, none
    again = run_job(capsys, *args, "--out", str(tmp_path / "b"))
    assert (held_out_vids(again["out"]) == held).all()
    plain = run_job(capsys, "--dataset", "ml-latest-small", "--out", str(tmp_path / "c"))
    assert plain["held_out_items"] == 0 and len(held_out_vids(plain["out"])) == 0
    with pytest.raises(prepare_data.InputError, match=r"--holdout-items must be in \[0, 1\)"):
        PrepareConfig(holdout_items=1.0)
