"""Bad input ends prepare_data with exit 2 and one line naming the file, column and row count;
nothing already published is touched, and a half-written folder is never read as complete."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import polars as pl
import pytest

from artifacts import storage
from pipelines import prepare_data
from pipelines.prepare_data import load_dataset
from tests.conftest import free_port


def fail(capsys, *args: str) -> str:
    """Run the job expecting a clean failure; returns the error line."""
    rc = prepare_data.main(list(args))
    out = capsys.readouterr()
    assert rc == 2, out
    assert out.out == ""  # no summary for a failed run
    (line,) = [ln for ln in out.err.splitlines() if ln.startswith("error: ")]
    return line


def write_shop(tmp_path, items: pl.DataFrame | None = None, log: pl.DataFrame | None = None):
    items = (
        items
        if items is not None
        else pl.DataFrame({"item_id": list(range(20)), "title": [f"thing {i}" for i in range(20)]})
    )
    log = (
        log
        if log is not None
        else pl.DataFrame(
            {"user_id": [1] * 6 + [2] * 6, "item_id": list(range(12)), "timestamp": list(range(12))}
        )
    )
    items_path, log_path = tmp_path / "items.csv", tmp_path / "log.csv"
    items.write_csv(items_path)
    log.write_csv(log_path)
    return str(items_path), str(log_path)


def byo(items: str, log: str, out: str, *extra: str) -> list[str]:
    return [
        "--dataset",
        "shop",
        "--items",
        items,
        "--interactions",
        log,
        "--out",
        out,
        "--negatives",
        "3",
        *extra,
    ]


def test_missing_column_is_named(tmp_path, capsys):
    items, log = write_shop(tmp_path)
    line = fail(capsys, *byo(items, log, str(tmp_path / "out"), "--text-cols", "title,brand"))
    assert items in line and "missing column(s) brand" in line and "item_id, title" in line


def test_duplicate_item_ids_are_counted(tmp_path, capsys):
    dup = pl.DataFrame({"item_id": [0, 1, 1, 2, 2, 2, 3], "title": list("abcdefg")})
    items, log = write_shop(
        tmp_path,
        items=dup,
        log=pl.DataFrame({"user_id": [1, 1, 1], "item_id": [0, 1, 3], "timestamp": [1, 2, 3]}),
    )
    line = fail(capsys, *byo(items, log, str(tmp_path / "out")))
    assert items in line and "item_id has 2 duplicated id(s) in 5 rows" in line


def test_unknown_items_in_interactions_are_counted(tmp_path, capsys):
    log = pl.DataFrame({"user_id": [1] * 5, "item_id": [0, 1, 99, 98, 99], "timestamp": range(5)})
    items, log_path = write_shop(tmp_path, log=log)
    line = fail(capsys, *byo(items, log_path, str(tmp_path / "out")))
    assert log_path in line and "3 interaction(s)" in line and "[98, 99]" in line


def test_unknown_string_items_are_counted(tmp_path, capsys):
    items_df = pl.DataFrame({"sku": ["a", "b", "c"], "title": ["x", "y", "z"]})
    log = pl.DataFrame({"user_id": [1] * 4, "sku": ["a", "b", "zz", "c"], "timestamp": range(4)})
    items, log_path = write_shop(tmp_path, items=items_df, log=log)
    line = fail(
        capsys,
        *byo(items, log_path, str(tmp_path / "out"), "--item-id-col", "sku", "--item-col", "sku"),
    )
    assert log_path in line and "column sku names 1 interaction(s)" in line and "zz" in line


def test_empty_text_is_counted(tmp_path, capsys):
    items_df = pl.DataFrame({"item_id": range(5), "title": ["a", "  ", None, "d", ""]})
    items, log = write_shop(
        tmp_path,
        items=items_df,
        log=pl.DataFrame({"user_id": [1, 1, 1], "item_id": [0, 3, 0], "timestamp": [1, 2, 3]}),
    )
    line = fail(capsys, *byo(items, log, str(tmp_path / "out")))
    assert items in line and "3 item(s) have empty text" in line and "[1, 2, 4]" in line


def test_undecodable_bytes_are_located(tmp_path, capsys):
    items, log = write_shop(tmp_path)
    with open(items, "ab") as f:
        f.write(b"20,caf\xe9 latin-1\n21,ok\n22,\xff\xfe\n")
    line = fail(capsys, *byo(items, log, str(tmp_path / "out")))
    assert items in line and "2 line(s) are not valid UTF-8 (first at line 22)" in line


def test_non_integer_timestamps_are_counted(tmp_path, capsys):
    log = pl.DataFrame({"user_id": [1] * 4, "item_id": range(4), "timestamp": ["1", "x", "3", "y"]})
    items, log_path = write_shop(tmp_path, log=log)
    line = fail(capsys, *byo(items, log_path, str(tmp_path / "out")))
    assert log_path in line and "timestamp has 2 value(s) that are not integers" in line


def test_unknown_dataset_lists_the_builtins(tmp_path, capsys):
    line = fail(capsys, "--dataset", "ml-25m", "--out", str(tmp_path))
    assert "unknown dataset 'ml-25m'" in line and "ml-latest-small" in line


def test_missing_input_file_is_named(tmp_path, capsys):
    _, log = write_shop(tmp_path)
    missing = str(tmp_path / "nope.csv")
    line = fail(capsys, *byo(missing, log, str(tmp_path / "out")))
    assert f"{missing} does not exist" in line


def test_too_few_negatives_possible(tmp_path, capsys):
    items, log = write_shop(tmp_path)
    line = fail(capsys, *byo(items, log, str(tmp_path / "out"))[:-2], "--negatives", "100")
    assert "leaving 14 possible negatives" in line and "--negatives" in line


def test_unreachable_s3_endpoint_fails_fast_and_cleanly(tmp_path):
    items, log = write_shop(tmp_path)
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_MAX_ATTEMPTS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.prepare_data", *byo(items, log, "s3://kvrank-x/root")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cannot write s3://kvrank-x/root" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_bucket_is_named(tmp_path, capsys, s3_endpoint):
    items, log = write_shop(tmp_path)
    line = fail(capsys, *byo(items, log, "s3://kvrank-no-such-bucket/root"))
    assert "s3://kvrank-no-such-bucket/root" in line


def tree(folder: str) -> dict[str, bytes]:
    """Every file under ``folder``, by relative path."""
    return {
        os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(folder)
        for n in names
    }


def test_failed_run_leaves_published_dataset_untouched(tmp_path, capsys):
    out = str(tmp_path / "out")
    items, log = write_shop(tmp_path)
    assert prepare_data.main(byo(items, log, out)) == 0
    capsys.readouterr()
    folder = prepare_data.dataset_uri(out, "shop")
    before = tree(folder)
    # the same dataset again, now with an unknown item in the log: the run must fail...
    bad_log = pl.DataFrame({"user_id": [1, 1, 1], "item_id": [0, 1, 500], "timestamp": [1, 2, 3]})
    bad_log.write_csv(log)
    fail(capsys, *byo(items, log, out))
    # ...and leave every published byte and no half-written version behind
    assert tree(folder) == before
    assert load_dataset(folder)["interactions"].height == 12


def test_a_crash_at_any_step_of_publishing_leaves_the_previous_version_current(
    tmp_path, capsys, monkeypatch
):
    out = str(tmp_path / "out")
    items, log = write_shop(tmp_path)
    assert prepare_data.main(byo(items, log, out)) == 0
    folder = prepare_data.dataset_uri(out, "shop")
    first = storage.resolve(folder)
    want = load_dataset(folder)["interactions"]
    # the next run publishes 13 interactions: three files, the version's marker, the pointer
    pl.DataFrame(
        {"user_id": [1] * 13, "item_id": [i % 4 for i in range(13)], "timestamp": range(13)}
    ).write_csv(log)
    real_write = storage.write_bytes
    writes = 5
    for crash_at in range(1, writes + 1):
        calls = {"n": 0}

        def crashing_write(uri, data, crash_at=crash_at, calls=calls):
            calls["n"] += 1
            if calls["n"] == crash_at:
                raise storage.StorageError(f"simulated crash at write {crash_at}")
            return real_write(uri, data)

        monkeypatch.setattr(storage, "write_bytes", crashing_write)
        with pytest.raises(storage.StorageError, match="simulated crash"):
            prepare_data.prepare(
                prepare_data.source_from_args(prepare_data.parse_args(byo(items, log, out))),
                out,
                prepare_data.PrepareConfig(negatives=3),
            )
        monkeypatch.setattr(storage, "write_bytes", real_write)
        assert storage.resolve(folder) == first, crash_at
        assert load_dataset(folder)["interactions"].equals(want), crash_at
    assert calls["n"] == writes  # the last crash hit the pointer: every step was tried
    # uninterrupted, the new version becomes current; a reader that resolved the old one (a
    # running deployment) still reads it, unchanged
    assert prepare_data.main(byo(items, log, out)) == 0
    assert storage.resolve(folder) != first
    assert load_dataset(folder)["interactions"].height == 13
    assert load_dataset(first)["interactions"].equals(want)


@pytest.mark.parametrize("change", ["append", "same size"])
def test_file_changed_after_publishing_is_detected(tmp_path, capsys, change):
    out = str(tmp_path / "out")
    items, log = write_shop(tmp_path)
    assert prepare_data.main(byo(items, log, out)) == 0
    folder = prepare_data.dataset_uri(out, "shop")
    path = os.path.join(storage.resolve(folder), "items.parquet")
    data = bytearray(open(path, "rb").read())
    if change == "append":
        data += b"junk"
    else:  # the size the marker records, one byte different: only the sha256 tells
        data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(storage.IncompleteError, match="changed after publishing"):
        load_dataset(folder)


def test_engine_is_checked_before_anything_is_written(tiny, capsys):
    from pipelines import encode_items, label_teacher

    args = ["--dataset-uri", tiny["dataset"], "--out", tiny["out"]]
    assert encode_items.main([*args, "--engine", "onnx"]) == 2
    assert "--engine must be one of hf, vllm; got 'onnx'" in capsys.readouterr().err
    teacher = ["--teacher", tiny["out"] + "/teachers/none", "--engine", "tensorrt"]
    assert label_teacher.main([*args, *teacher]) == 2
    assert "--engine must be one of hf, vllm" in capsys.readouterr().err
    assert not storage.exists(storage.join(tiny["out"], "item_vectors"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_says_how_to_get_it(tiny, capsys):
    from pipelines import encode_items

    args = ["--dataset-uri", tiny["dataset"], "--out", tiny["out"], "--engine", "vllm"]
    assert encode_items.main(args) == 2
    err = capsys.readouterr().err
    assert "--engine vllm needs vLLM" in err and "make vllm-env" in err
    assert not storage.exists(storage.join(tiny["out"], "item_vectors"))


def test_a_checkpoint_changed_after_publishing_is_refused_at_load(tmp_path):
    """A ranker checkpoint whose weights were swapped after publishing (same size: only the
    sha256 tells) is refused before torch reads a byte of it; and torch reads weights only."""
    import io
    import json

    import torch

    from artifacts.data import load_checkpoint
    from tests.test_ranker import N_ITEMS, tiny_ranker

    model = tiny_ranker(item_input="id")
    weights = io.BytesIO()
    torch.save(model.state_dict(), weights)
    pub = storage.Publication(str(tmp_path / "checkpoint"))
    pub.put_bytes("model.pt", weights.getvalue())
    pub.put_bytes("ranker.json", model.cfg.to_json().encode())
    pub.put_bytes("train.json", json.dumps({"max_len": 10}).encode())
    folder = storage.root_of(pub.publish({"n_items": N_ITEMS})["uri"])
    loaded, _ = load_checkpoint(folder)
    pairs = zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    path = os.path.join(storage.resolve(folder), "model.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(storage.IncompleteError, match="model.pt does not match the sha256"):
        load_checkpoint(folder)
