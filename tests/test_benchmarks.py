"""The benchmarks run end to end on tiny sizes and write the JSON they promise (structure only:
speed is measured by the benchmarks themselves, never asserted in tests)."""

from __future__ import annotations

import json
import subprocess
import sys


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
