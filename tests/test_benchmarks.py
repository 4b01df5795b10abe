"""The benchmarks run end to end on tiny sizes and write the JSON they promise (structure only:
speed is measured by the benchmarks themselves, never asserted in tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_scoring_benchmark_writes_all_four_paths(tmp_path):
    out = tmp_path / "scoring.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scoring",
            "--lengths",
            "3",
            "--candidates",
            "2,5",
            "--sample",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert report["state_over_full_kv"] == 8 / 1024
    assert [(r["history_length"], r["candidates"]) for r in report["results"]] == [(3, 2), (3, 5)]
    for row in report["results"]:
        for path in ("full", "prefix", "mis", "mis_ckv"):
            assert row[path]["scores_per_s"] > 0 and 0 < row[path]["share_of_peak"]
    assert report["bytes_per_user"]["3"]["full_kv_fp16"] == 4 * 2 * 2 * 256 * 2


def test_state_store_benchmark_measures_both_engines_and_keeps_other_rows(tmp_path):
    out = tmp_path / "state_store.json"
    other = {"engine": "sqlite", "users": 7, "note": "an earlier row of another size"}
    out.write_text(json.dumps({"rows": [other]}))
    args = ["--users", "3000", "--seconds", "0.3", "--json", str(out)]
    args += ["--out", str(tmp_path / "scratch")]
    subprocess.run(
        [sys.executable, "-m", "benchmarks.state_store", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["users"]) for r in rows] == [
        ("sqlite", 7),
        ("sqlite", 3000),
        ("redis", 3000),
    ]
    for r in rows[1:]:
        assert r["kill9_acked"] == 500 and r["acked_lost"] == 0
        assert r["packed_bytes_per_user"] == 1054 and r["disk_bytes_per_user"] > 0
    assert rows[2]["memory_bytes_per_user"] > rows[2]["packed_bytes_per_user"]
    assert not (tmp_path / "scratch" / "sqlite-3000").exists()  # the scratch data is removed


def test_serve_load_fills_a_store_the_app_opens_as_it_is(tiny_trained, tmp_path):
    """``serve_load --store-users``: the filled store names the manifest it stands for, so a
    store shard opens it without loading the manifest again, and user u is the manifest's
    (u mod n)-th user under its own id."""
    from artifacts import states
    from benchmarks.serve_load import fill_store
    from services.store import ShardStore

    manifest_uri = tiny_trained["states"]["user_states"]
    _, table = states.read_states(manifest_uri)
    rows = table.to_pylist()
    store_uri, users = str(tmp_path / "store"), 1_000
    figures = fill_store(manifest_uri, store_uri, shards=2, users=users)
    assert figures["mean_packed_bytes"] > 0
    for shard in (0, 1):
        store = ShardStore(manifest_uri, store_uri, shard, 2)
        try:
            assert store.writer.stats()["users"] == users // 2  # not the manifest's 40 again
            for u in (shard, shard + 2 * 321, users - 2 + shard):
                version, got = store.get(u)
                want = rows[u % len(rows)]
                assert version == 1 and got["user_id"] == u
                assert {k: v for k, v in got.items() if k != "user_id"} == {
                    k: v for k, v in want.items() if k in got and k != "user_id"
                }
            assert store.get(users + shard) is None
        finally:
            store.close()


def test_the_ramp_timeline_bins_requests_and_replica_readings_by_second():
    """benchmarks.serve_ramp's per-second rows: the phase's clients, the replicas the sampler
    read last, the scores, p99 and failures of the requests that ended in that second."""
    from benchmarks.serve_ramp import timeline

    t0 = 1000.0
    record = [(t0 + 0.2, 0.010, True), (t0 + 0.7, 0.030, True), (t0 + 1.5, 0.5, False)]
    record += [(t0 + 2.1, 0.020, True)]
    samples = [(t0 + 0.1, 1), (t0 + 1.9, 2)]
    rows = timeline(record, samples, [(1, 2.0), (64, 5.0)], t0, n_cands=100)
    assert [r["concurrency"] for r in rows] == [1, 1, 64]
    assert [r["replicas"] for r in rows] == [1, 2, 2]
    assert [r["scores_per_s"] for r in rows] == [200, 0, 100]
    assert [r["errors"] for r in rows] == [0, 1, 0]
    assert rows[0]["p99_ms"] == 29.8 and rows[1]["p99_ms"] is None


def test_train_throughput_times_both_batchings_of_the_jobs_windows(tiny, tmp_path):
    """benchmarks.train_throughput on the tiny dataset (id items: no vectors): a row per
    dataset and label with both batchings, their real-token shares and the negatives it trained
    with, and a second label kept; ``--baseline`` adds the 2026-12-05 step in the same run."""
    from benchmarks import train_throughput
    from tests.tiny import TINY_MODEL

    path = tmp_path / "throughput.json"
    args = ["--dataset-uri", tiny["dataset"], "--out", tiny["out"], "--item-input", "id"]
    args += [*TINY_MODEL, "--batch-size", "4", "--max-len", "10", "--val-users", "8"]
    for label, negatives, more in (("a", "5", []), ("b", "2", ["--baseline"])):
        argv = ["--steps", "3", "--label", label, "--json", str(path), *more, *args]
        train_throughput.main([*argv, "--negatives", negatives])
    report = json.loads(path.read_text())
    assert [(r["dataset"], r["label"]) for r in report["rows"]] == [("tiny", "a"), ("tiny", "b")]
    assert [r["negatives"] for r in report["rows"]] == [5, 2]  # the row names what it trained
    # each cut point scores 1 + negatives candidates: fewer negatives, fewer tokens a window
    tokens = [r["mixed"]["tokens_per_window"] for r in report["rows"]]
    assert tokens[1] < tokens[0]
    row = report["rows"][0]
    for batching in ("mixed", "bucketed"):
        figures = row[batching]
        assert figures["steps"] == 3 and figures["windows_per_second"] > 0
        assert 0 < figures["real_token_share"] <= 1
        assert set(figures["phase_ms"]) == {"data", "forward", "backward", "optimizer"}
    # grouping by length never computes more padding than batches of mixed lengths
    assert row["bucketed"]["real_token_share"] >= row["mixed"]["real_token_share"]
    assert row["validation"]["users"] == 8
    assert "baseline" not in row
    # the baseline: batches of 32 windows of mixed lengths with 31 negatives, on this process
    b = report["rows"][1]
    assert b["baseline"]["steps"] == 3
    assert b["baseline"]["tokens_per_window"] > b["mixed"]["tokens_per_window"]
    assert b["baseline_speedup"] == round(
        b["bucketed"]["windows_per_second"] / b["baseline"]["windows_per_second"], 2
    )


def test_the_benchmarks_fit_the_prior_first_for_a_recipe_that_mines_negatives_from_it():
    """The amazon recipe's ranker mines negatives from the prior (its quality and cold-start
    runs then fit the prior before training); ml-latest-small's and the demo's do not."""
    import yaml

    from benchmarks.report import mines_negatives

    def recipe(name: str) -> dict:
        with open(f"configs/{name}.yaml") as fh:
            return yaml.safe_load(fh)

    assert mines_negatives(recipe("amazon-videogames-2018"))
    assert not mines_negatives(recipe("ml-latest-small")) and not mines_negatives(recipe("demo"))
    assert not mines_negatives({"prepare_data": {"dataset": "x"}, "train_ranker": None})


@pytest.mark.parametrize(
    "recipe, more, order",
    [
        ("ml-latest-small", [], ["prepare", "encode", "train", "fit prior", "evaluate"]),
        ("amazon-videogames-2018", [], ["prepare", "encode", "fit prior", "train", "evaluate"]),
        (
            "ml-latest-small",
            ["--complementary"],
            ["prepare", "encode", "fit prior", "train", "evaluate"],
        ),
    ],
)
def test_the_quality_benchmark_fits_the_prior_before_a_ranker_that_needs_it(recipe, more, order):
    """benchmarks.quality's jobs in order: the prior after training, unless the ranker mines
    negatives from it (the amazon recipe) or trains on the fused score (--complementary); the
    ranker then gets the prior that evaluate fuses with, and a complementary one is fused at
    its learned weight."""
    import yaml

    from benchmarks import quality

    config = f"configs/{recipe}.yaml"
    a = quality.build_parser().parse_args(["--config", config, *more])
    with open(config) as fh:
        stages = quality.plan(a, yaml.safe_load(fh), "/o")
    assert [name for name, _, _ in stages] == order
    argv = {name: args for name, _, args in stages}
    prior = f"/o/item_priors/{recipe}/{recipe}-recipe-prior"
    mined = recipe == "amazon-videogames-2018"
    assert ("--negatives-prior" in argv["train"]) == mined
    if mined:
        assert argv["train"][argv["train"].index("--negatives-prior") + 1] == prior
    assert ("--item-prior" in argv["train"]) == bool(more)
    assert ("--item-prior" in argv["evaluate"]) == (not more)
