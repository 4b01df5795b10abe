"""Where a ranker training step goes, and how many windows a second training runs.

    python -m benchmarks.train_throughput --config configs/amazon-videogames-2018.yaml \\
        --dataset-uri out/datasets/amazon-videogames-2018 --out out \\
        [--steps 60] [--label NAME] [--baseline] [--ray-steps 200] [--json FILE]

The options after the benchmark's own are ``train_ranker``'s (a recipe and overrides): the
model, the batches and the loss are exactly the job's. On one process without Ray it runs
``--steps`` training steps of the job's step functions (``ranker_batch``, ``ranker_loss``, the
backward pass, the optimizer with the weight average) over the job's training windows in a
seeded order, timing each phase, and one validation pass over ``--val-users`` users; it counts
the tokens each step computes (the prefill, the user tokens, the candidates) and how many are
real rather than padding. ``--baseline`` times, in the same run, the training step of
2026-12-05 on the same model and windows (``BASELINE``): the ratio the recipe's speed is quoted
against. With ``--ray-steps`` it then runs the ``train_ranker`` job itself for
one epoch capped at that many steps (Ray Train fed by Ray Data) and reads the windows/s of its
training time. The report keeps one row per dataset and ``--label`` (a rerun replaces its row).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks.report import machine, write


def count_tokens(tb) -> dict[str, int]:
    """Tokens a training forward computes for this batch, and the real ones among them: the
    prefill runs BOS + the padded history, the step one user token per padded position plus
    every candidate."""
    lengths = tb.history.lengths.numpy()
    b, t = tb.history.vids.shape
    n = tb.candidates.shape[1]
    computed = b * (1 + t) + b * (t + n)
    real = int((1 + lengths).sum() + lengths.sum()) + b * n
    return {"computed": computed, "real": real}


def untrained(rc, tc, dataset_uri: str, vectors_uri: str | None):
    """The job's ranker at its seeded start, with its item table: (model, catalog size)."""
    import torch

    from artifacts import storage
    from artifacts.data import item_table
    from models.ranker import Ranker

    torch.manual_seed(tc.seed)
    n_items = int(storage.read_marker(dataset_uri)["items"])
    model = Ranker(rc, n_items=n_items)
    if rc.reads_vectors:
        model.set_item_table(item_table(vectors_uri, n_items)[0])
    return model, n_items


def in_process(
    rc,
    tc,
    dataset_uri: str,
    vectors_uri: str | None,
    steps: int,
    chunk_batches: int,
    negatives_prior: str | None = None,
    per_tensor_adamw: bool = False,
) -> dict:
    """``steps`` steps of the job's step functions on this process, phase by phase, the
    windows read in chunks of ``chunk_batches`` batches (as a Ray Train worker reads them: 1 is
    batches of whatever lengths the shuffle put together); ``negatives_prior``: the item prior
    ``tc.prior_negatives`` of each cut's negatives are mined from; ``per_tensor_adamw``: AdamW's
    loop over the weights instead of the job's fused kernel (the baseline's)."""
    import torch

    from artifacts.data import training_windows, user_sequences
    from pipelines.common.prior_offsets import load_negatives_prior
    from pipelines.common.ranker_training import ranker_batches, ranker_loss
    from pipelines.common.training import optimizer, weight_average

    model, n_items = untrained(rc, tc, dataset_uri, vectors_uri)
    miner = load_negatives_prior(negatives_prior, n_items) if tc.prior_negatives else None
    opt = (
        torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, foreach=False)
        if per_tensor_adamw
        else optimizer(model, tc)
    )
    average = weight_average(model, tc.ema_decay, None)
    seqs = user_sequences(dataset_uri)
    users = seqs.filter(seqs["hist"].list.len() >= 2).select("user_id", "hist", "hist_fb")
    windows = training_windows(users, tc.max_len).sample(fraction=1.0, shuffle=True, seed=tc.seed)
    rng = np.random.default_rng(tc.seed)
    chunk = tc.batch_size * chunk_batches

    def batches():
        while True:  # round the windows again when the steps outlast them (a small dataset)
            for start in range(0, windows.height, chunk):
                rows = windows.slice(start, chunk)
                cols = {c: [np.asarray(x) for x in rows[c].to_list()] for c in ("hist", "hist_fb")}
                yield from ranker_batches(cols, rng, tc, n_items)

    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    tokens = {"computed": 0, "real": 0}
    done = 0
    model.train()
    feed = batches()
    for i in range(steps + 1):  # the first step warms up (allocations, thread pools): not timed
        t0 = time.perf_counter()
        tb = next(feed)
        t1 = time.perf_counter()
        loss, _ = ranker_loss(model, tb, tc, torch.device("cpu"), miner=miner)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if average is not None:
            average.update_parameters(model)
        t4 = time.perf_counter()
        if i == 0:
            continue
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name] += seconds
        for k, v in count_tokens(tb).items():
            tokens[k] += v
        done += len(tb.history.lengths)
    total = sum(phases.values())
    return {
        "chunk_batches": chunk_batches,
        "steps": steps,
        "windows_per_second": round(done / total, 1),
        "step_ms": round(1000 * total / steps, 1),
        "phase_ms": {k: round(1000 * v / steps, 1) for k, v in phases.items()},
        "real_token_share": round(tokens["real"] / tokens["computed"], 3),
        "tokens_per_window": round(tokens["computed"] / done, 1),
        "epoch_windows": windows.height,
        "epoch_train_seconds_estimate": round(windows.height * total / done, 1),
    }


# the training step as it was on 2026-12-05, what the recipes' windows/s are measured against:
# batches of 32 windows of mixed lengths, 31 uniform negatives a cut, AdamW's per-tensor loop
BASELINE = {"batch_size": 32, "negatives": 31, "prior_negatives": 0}


def baseline_step(rc, tc, dataset_uri: str, vectors_uri: str | None, steps: int) -> dict:
    """``in_process`` of the 2026-12-05 step on the same model and data (``BASELINE``)."""
    import dataclasses

    base = dataclasses.replace(tc, **BASELINE)
    return in_process(rc, base, dataset_uri, vectors_uri, steps, 1, per_tensor_adamw=True)


def validation_seconds(rc, tc, dataset_uri: str, vectors_uri: str | None) -> dict:
    """One validation pass of an untrained ranker over the recipe's validation users."""
    from pipelines.common.validation import load_val, validate

    model, n_items = untrained(rc, tc, dataset_uri, vectors_uri)
    val = load_val(dataset_uri, tc.val_users, tc.seed)
    t0 = time.perf_counter()
    validate(model, val, n_items, tc.max_len, 0, 1, tc.val_score)
    return {"seconds": round(time.perf_counter() - t0, 1), "users": len(val["valid"])}


def through_ray(job_argv: list[str], steps: int) -> dict:
    """The train_ranker job itself for one epoch of at most ``steps`` steps."""
    from artifacts import storage
    from pipelines import train_ranker

    with tempfile.TemporaryDirectory() as d:
        argv = [*job_argv, "--out", d, "--run", "throughput", "--epochs", "1"]
        argv += ["--max-steps", str(steps), "--val-users", "1"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = train_ranker.main(argv)
        if rc != 0:
            raise RuntimeError(f"train_ranker failed (rc {rc})")
        summary = json.loads(buf.getvalue().strip().splitlines()[-1])
        history = json.loads(storage.read_file(summary["checkpoint"], "metrics.json"))
    epoch = history[0]
    return {
        "steps": epoch["steps"],
        "train_seconds": round(epoch["train_seconds"], 1),
        "job_seconds": summary["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="every other option is train_ranker's (python -m pipelines.train_ranker --help)",
    )
    p.add_argument("--steps", type=int, default=60, help="timed steps on this process")
    p.add_argument("--ray-steps", type=int, default=0, help="steps of the job itself (0: none)")
    p.add_argument("--label", default="current", help="the report row's name")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also time the training step of 2026-12-05 (batches of 32 windows of mixed "
        "lengths, 31 uniform negatives, AdamW's per-tensor loop) in the same run",
    )
    p.add_argument("--json", default="benchmarks/results/train_throughput.json")
    a, job_argv = p.parse_known_args(argv)

    from artifacts import storage
    from pipelines import train_ranker
    from pipelines.common import cli, jobs
    from pipelines.common.training import BUCKET_BATCHES

    jobs.setup_logging()
    job = cli.parse(train_ranker.build_parser(), job_argv)
    marker = storage.read_marker(job.dataset_uri)
    rc, tc = train_ranker.configs_from_args(job, int(marker.get("feedback_classes", 5)))
    vectors = job.vectors_uri
    if vectors is None and rc.reads_vectors:
        from artifacts.data import default_vectors_uri

        vectors = default_vectors_uri(job.out, marker["name"])
    row = {
        "label": a.label,
        "dataset": marker["name"],
        "batch_size": tc.batch_size,
        "negatives": tc.negatives,
        "item_input": rc.item_input,
        "threads": __import__("torch").get_num_threads(),
        "prior_negatives": tc.prior_negatives,
        "mixed": in_process(rc, tc, job.dataset_uri, vectors, a.steps, 1, job.negatives_prior),
        "bucketed": in_process(
            rc, tc, job.dataset_uri, vectors, a.steps, BUCKET_BATCHES, job.negatives_prior
        ),
        "validation": validation_seconds(rc, tc, job.dataset_uri, vectors),
    }
    row["bucketed_speedup"] = round(
        row["bucketed"]["windows_per_second"] / row["mixed"]["windows_per_second"], 2
    )
    if a.baseline:
        row["baseline"] = baseline_step(rc, tc, job.dataset_uri, vectors, a.steps)
        row["baseline_speedup"] = round(
            row["bucketed"]["windows_per_second"] / row["baseline"]["windows_per_second"], 2
        )
    if a.ray_steps:
        ray_run = through_ray(
            [*job_argv, "--vectors-uri", vectors] if vectors else job_argv, a.ray_steps
        )
        # an epoch's last batch may be short
        ray_run["windows"] = min(ray_run["steps"] * tc.batch_size, row["mixed"]["epoch_windows"])
        ray_run["windows_per_second"] = round(ray_run["windows"] / ray_run["train_seconds"], 1)
        row["ray_train"] = ray_run
    report = {"benchmark": "train_throughput", "machine": machine(), "rows": []}
    if os.path.exists(a.json):
        with open(a.json) as f:
            report = json.load(f)
    key = (row["dataset"], row["label"])
    report["rows"] = [r for r in report["rows"] if (r["dataset"], r["label"]) != key] + [row]
    report["machine"] = machine()
    write(a.json, report)
    print(json.dumps({"benchmark": "train_throughput", **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
