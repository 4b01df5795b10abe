"""The same job reading from and writing to s3:// on moto's S3 server (127.0.0.1)."""

from __future__ import annotations

import json
import os

import polars as pl
import s3fs

from artifacts import storage
from pipelines import prepare_data
from pipelines.prepare_data import load_dataset


def upload(local_dir: str, uri: str) -> None:
    fs = s3fs.S3FileSystem()
    for name in os.listdir(local_dir):
        fs.put(os.path.join(local_dir, name), f"{uri.removeprefix('s3://')}/{name}")


def test_prepare_reads_and_writes_s3(tmp_path, data_dir, s3_bucket, capsys, ray_local):
    # the raw data itself lives in the bucket: --data-dir is an s3:// URI too
    upload(os.path.join(data_dir, "ml-latest-small"), f"{s3_bucket}/raw/ml-latest-small")
    out = f"{s3_bucket}/kv"
    rc = prepare_data.main(
        ["--dataset", "ml-latest-small", "--data-dir", f"{s3_bucket}/raw", "--out", out]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["out"] == f"{out}/datasets/ml-latest-small"
    assert (summary["users"], summary["interactions"]) == (610, 100_836)

    remote = load_dataset(summary["out"])
    assert remote["splits"].height == 610
    # same bytes of meaning as a local run
    local = load_dataset(
        json.loads(_run(capsys, ["--dataset", "ml-latest-small", "--out", str(tmp_path)]))["out"]
    )
    for name in ("items", "interactions", "splits"):
        assert remote[name].equals(local[name]), name
    # one sealed version and the pointer to it; no probe object is left in the bucket
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    names = fs.ls(summary["out"].removeprefix("s3://"))
    assert sorted(os.path.basename(n) for n in names) == ["_SUCCESS.json", "_v"]
    version = storage.resolve(summary["out"])
    assert sorted(os.path.basename(n) for n in fs.ls(version.removeprefix("s3://"))) == [
        "_SUCCESS.json",
        "interactions.parquet",
        "items.parquet",
        "splits.parquet",
    ]
    assert not [n for n in fs.ls(out.removeprefix("s3://")) if ".kvrank-probe" in n]

    # Ray Data reads the published table straight from S3
    ds = ray_local.data.read_parquet(f"{version}/interactions.parquet")
    assert ds.count() == 100_836


def test_bring_your_own_from_s3(tmp_path, s3_bucket, capsys):
    items = pl.DataFrame({"item_id": range(10), "title": [f"t{i}" for i in range(10)]})
    seqs = pl.DataFrame({"user_id": [5, 6], "item_ids": ["0 1 2 3", "9 8 7"]})
    items.write_parquet(tmp_path / "items.parquet")
    seqs.write_csv(tmp_path / "seq.tsv", separator="\t")
    upload(str(tmp_path), f"{s3_bucket}/in")
    summary = json.loads(
        _run(
            capsys,
            [
                "--dataset",
                "tiny",
                "--items",
                f"{s3_bucket}/in/items.parquet",
                "--sequences",
                f"{s3_bucket}/in/seq.tsv",
                "--negatives",
                "2",
                "--out",
                f"{s3_bucket}/o",
            ],
        )
    )
    assert (summary["users"], summary["items"], summary["interactions"]) == (2, 10, 7)
    splits = load_dataset(summary["out"])["splits"].sort("user_id")
    assert splits["test_item"].to_list() == [3, 7]
    assert storage.read_marker(summary["out"])["ts_kind"] == "ordinal"


def _run(capsys, args: list[str]) -> str:
    rc = prepare_data.main(args)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out
