"""Benchmark of pipelines.prepare_data: wall time, throughput and peak memory per dataset.

    python -m benchmarks.prepare_data [--repeats 3] [--out benchmarks/results/prepare_data.json]

Each dataset is prepared ``--repeats`` times into a temporary folder in a fresh subprocess (so
peak RSS is the job's own); the median wall time is reported with the spread.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import report as report_file

DATASETS = ("ml-latest-small", "amazon-videogames-2018")


def run_once(dataset: str, out: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.prepare_data", "--dataset", dataset, "--out", out],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - t0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "job_s": summary["seconds"], "summary": summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/prepare_data.json")
    a = p.parse_args()
    results = {}
    for ds in DATASETS:
        runs = []
        for i in range(a.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_once(ds, tmp))
            print(f"{ds} run {i + 1}/{a.repeats}: {runs[-1]['job_s']:.2f} s", file=sys.stderr)
        job_s = [r["job_s"] for r in runs]
        s = runs[0]["summary"]
        results[ds] = {
            "users": s["users"],
            "items": s["items"],
            "interactions": s["interactions"],
            "job_seconds_median": round(statistics.median(job_s), 3),
            "job_seconds_min": round(min(job_s), 3),
            "job_seconds_max": round(max(job_s), 3),
            "process_seconds_median": round(statistics.median(r["wall_s"] for r in runs), 3),
            "interactions_per_second": round(s["interactions"] / statistics.median(job_s)),
        }
    # ru_maxrss of finished children: the largest peak RSS among the job processes (KiB on Linux)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    report = {
        "benchmark": "prepare_data",
        "machine": report_file.machine(),
        "repeats": a.repeats,
        "peak_rss_mib_any_run": round(peak_kib / 1024, 1),
        "datasets": results,
    }
    report_file.write(a.out, report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
