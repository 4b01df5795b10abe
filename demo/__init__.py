"""The whole chain in one command, on the embedded local Ray: ``make demo``.

    python -m demo [--out out] [--config configs/demo.yaml] [--dataset ml-latest-small]
        [--load-seconds 10] [--load-concurrency 8]

Stages, each the same job an operator submits with ``ray job submit`` (its command line is
printed before it runs), every one reading its options from the recipe ``configs/demo.yaml``
(the defaults on a smaller budget): prepare -> encode -> train -> fit the item prior -> analyse
the KV -> fit the CollectiveKV pools -> build user states -> evaluate (from the stored states:
the ranker, its uncompressed base, the prior, the two fused as serving ranks, most-popular) ->
serve. The serve stage starts the Serve app over the states, with the prior at the weight
evaluate picked (a weight of 0, the ranker alone, serves without it), ranks the whole catalog
for one user over HTTP and prints their history and top 10 with titles, then runs a short
closed-loop load. The jobs share one Ray, started once. The closing table puts the figures
beside the full recipe's committed ones (``benchmarks/results/quality_<dataset>.json``).

Writes ``<out>/reports/demo/``: summary.json (every stage's JSON summary and wall time),
summary.md (the tables printed at the end) and stage_seconds.png; the jobs' own reports (metrics
and plots) sit beside it under ``<out>/reports/``. Ends with a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import pathlib
import random
import sys
import time
from collections.abc import Callable

log = logging.getLogger("kvrank.demo")
RECIPE = pathlib.Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


class _Tee(io.TextIOBase):
    """stdout that is also kept, so a job's JSON summary line can be read back."""

    def __init__(self, real) -> None:
        self.real, self.kept = real, io.StringIO()

    def write(self, s: str) -> int:
        self.real.write(s)
        return self.kept.write(s)

    def flush(self) -> None:
        self.real.flush()


def run_stage(name: str, main: Callable[[list[str]], int], module: str, argv: list[str]) -> dict:
    """Run one job's ``main(argv)`` in this process; its summary and wall time, or exit."""
    print(f"\n== {name}: python -m {module} {' '.join(argv)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"demo stopped: stage {name!r} failed (exit {rc}); see its error above")
    lines = [ln for ln in tee.kept.getvalue().splitlines() if ln.startswith("{")]
    return {"stage": name, "seconds": round(time.perf_counter() - t0, 1)} | json.loads(lines[-1])


def titles_of(dataset_uri: str) -> dict[int, str]:
    from artifacts import storage

    items = storage.read_table(dataset_uri, "items.parquet")
    col = "title" if "title" in items.column_names else "text"
    return dict(zip(items["item_id"].to_pylist(), items[col].to_pylist(), strict=True))


def serve_stage(states_uri: str, seconds: float, concurrency: int, port: int, report: str) -> dict:
    """Serve what the evaluate ``report`` measured (the states at ``states_uri``, fused with
    the prior at the weight it picked), show one user's top 10 of the whole catalog
    (/v1/recommend), then a short load."""
    import httpx
    import numpy as np
    from ray import serve

    from artifacts import states, storage
    from services.app import build_app
    from services.load import closed_loop

    t0 = time.perf_counter()
    manifest, table = states.read_states(states_uri)
    items = storage.read_table(manifest["dataset_uri"], "items.parquet")
    item_of_vid = dict(zip(items["vid"].to_pylist(), items["item_id"].to_pylist(), strict=True))
    titles = titles_of(manifest["dataset_uri"])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"manifest_uri": report}), name="kvrank", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter() - t0
    try:
        # the user with the median history length: a typical one
        lengths = np.asarray(table["length"].to_pylist())
        row = table.slice(int(np.argsort(lengths)[len(lengths) // 2]), 1).to_pylist()[0]
        user, hist = row["user_id"], [item_of_vid[v] for v in row["hist"]]
        seen = set(hist)
        catalog = [i for i in items["item_id"].to_pylist() if i not in seen]
        t_rank = time.perf_counter()
        with httpx.Client(timeout=120) as client:
            # one call: the catalog retrieved by the user vector and the prior, then ranked
            r = client.post(f"{url}/v1/recommend", json={"user_id": user, "k": 10})
            r.raise_for_status()
            best = r.json()["items"]
            rank_ms = (time.perf_counter() - t_rank) * 1000
            stats = client.get(f"{url}/v1/stats").json()
        feedback = row["hist_fb"]
        print(f"\nuser {user}: {len(hist)} items in the history; the last 10 (feedback class):")
        for item, fb in list(zip(hist, feedback, strict=True))[-10:]:
            print(f"  {'?' if fb < 0 else fb}  {titles.get(item, item)}")
        print(f"top 10 of {len(catalog):,} unseen items (/v1/recommend, {rank_ms:.0f} ms):")
        for x in best:
            print(f"  {x['score']:8.3f}  {titles.get(x['item_id'], x['item_id'])}")
        users = table["user_id"].to_pylist()
        rng = random.Random(0)
        bodies = [
            {"user_id": rng.choice(users), "candidate_item_ids": rng.sample(catalog, 100), "k": 10}
            for _ in range(256)
        ]
        asyncio.run(closed_loop(f"{url}/v1/rank", bodies, 1, 2.0))  # warm-up
        load = asyncio.run(closed_loop(f"{url}/v1/rank", bodies, concurrency, seconds))
    finally:
        serve.shutdown()
    return {
        "stage": "serve",
        "seconds": round(time.perf_counter() - t0, 1),
        "startup_seconds": round(started, 1),
        "user": user,
        "top10": [x["item_id"] for x in best],
        "top10_titles": [titles.get(x["item_id"]) for x in best],
        "recommend_ms": round(rank_ms, 1),
        "store_users": stats.get("store", {}).get("users"),
        "load": load,
    }


def budget(recipe: str) -> dict:
    """What the recipe gives the demo's training, beside the full recipe's."""
    import yaml

    with open(recipe) as fh:
        doc = yaml.safe_load(fh) or {}
    train, pools = doc.get("train_ranker") or {}, doc.get("train_kv_pool") or {}
    return {
        "train_epochs": train.get("epochs"),
        "kv_epochs": pools.get("epochs"),
        "kv_max_steps": pools.get("max_steps"),
        "test_users": (doc.get("evaluate") or {}).get("max_users", "all"),
    }


def full_recipe(dataset: str) -> dict | None:
    """The full recipe's committed figures for ``dataset`` (benchmarks/results/quality_*.json):
    its evaluate summary and the references, or None when there are none."""
    path = RECIPE.parent.parent / "benchmarks" / "results" / f"quality_{dataset}.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    ev = next(s for s in report["stages"] if s["stage"] == "evaluate")
    return ev | report["references"] | {"recipe": report["recipe"], "date": report["date"]}


def tables(stages: list[dict], reference: dict | None = None) -> str:
    """The summary as Markdown: time per stage, quality (beside the full recipe's and the
    references when given), compression, throughput."""
    by = {s["stage"]: s for s in stages}
    out = ["| stage | seconds |", "|---|---|"]
    out += [f"| {s['stage']} | {s['seconds']:.1f} |" for s in stages]
    out.append(f"| **total** | **{sum(s['seconds'] for s in stages):.1f}** |")
    ev, ref = by["evaluate"], reference or {}
    head = f"| full-catalog, {ev.get('users', '?')} test users | NDCG@10 | HR@10 |"
    if ref:
        head += f" full recipe ({ref['recipe']}, {ref['date']}) NDCG@10 |"
    out += ["", head, "|---|---|---|" + ("---|" if ref else "")]
    weight = ev.get("fusion_weight")
    for label, key, ref_key in (
        ("ranker, fp16 KV", "uncompressed", "ranker"),
        ("ranker from the stored CollectiveKV states", "ranker", None),
        ("item-to-item prior alone", "item_prior", "item_prior"),
        (f"**served**: states + prior (weight {weight})", "ranker_prior", "ranker_prior"),
        ("most popular", "most_popular", "most_popular"),
    ):
        if f"{key}_full_ndcg10" not in ev:
            continue
        row = f"| {label} | {ev[f'{key}_full_ndcg10']:.4f} | {ev[f'{key}_full_hr10']:.4f} |"
        if ref:
            got = ref.get(f"{ref_key}_full_ndcg10") if ref_key else None
            row += f" {got:.4f} |" if got is not None else " |"
        out.append(row)
    if ref.get("target_ndcg10"):
        out.append(
            f"\nreferences: quality target NDCG@10 {ref['target_ndcg10']}, SASRec "
            f"{ref['sasrec_ndcg10']} (same protocol)"
        )
    b = by["build states"]
    out += [
        "",
        "| users | cached tokens | state bytes | fp16 KV bytes | ratio | bytes / user |",
        "|---|---|---|---|---|---|",
        f"| {b['users']:,} | {b['tokens']:,} | {b['state_bytes']:,} | {b['full_kv_bytes']:,} "
        f"| {b['ratio']:.3%} | {b['bytes_per_user']:,.0f} |",
    ]
    ld = by["serve"]["load"]
    out += [
        "",
        "| concurrency | requests | candidate scores/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
        f"| {ld['concurrency']} | {ld['requests']} | {ld['candidate_scores_per_s']:,.0f} "
        f"| {ld['p50_ms']} | {ld['p99_ms']} | {ld['errors']} |",
    ]
    return "\n".join(out)


def plot_stages(stages: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [s["stage"] for s in stages]
    ax.barh(names[::-1], [s["seconds"] for s in stages][::-1], color="#4c72b0")
    ax.set_xlabel("wall seconds")
    ax.set_title("make demo: time per stage")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    from artifacts import storage
    from pipelines import (
        analyze_kv,
        build_user_states,
        encode_items,
        evaluate,
        fit_item_prior,
        prepare_data,
        train_kv_pool,
        train_ranker,
    )
    from pipelines.common import jobs

    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out", help="output root (default: %(default)s)")
    p.add_argument(
        "--config", default=str(RECIPE), help="the recipe every job reads (default: %(default)s)"
    )
    p.add_argument("--dataset", default="ml-latest-small", help="default: %(default)s")
    p.add_argument("--data-dir", default=None, help="default: $KVRANK_DATA_DIR, ../shared/data")
    p.add_argument("--load-seconds", type=float, default=10.0, help="default: %(default)s")
    p.add_argument("--load-concurrency", type=int, default=8, help="default: %(default)s")
    p.add_argument("--port", type=int, default=0, help="HTTP port of the app (0: a free one)")
    a = p.parse_args(argv)
    jobs.setup_logging()
    t0 = time.perf_counter()
    out = storage.absolute(a.out)
    ds = storage.join(out, "datasets", a.dataset)
    text_ckpt = storage.join(out, "checkpoints", f"{a.dataset}-text-id")  # train_ranker's name
    ckv_run = f"{a.dataset}-ckv"
    states_uri = storage.join(out, "user_states", ckv_run)
    prior_uri = storage.join(out, "item_priors", a.dataset, fit_item_prior.default_run(a.dataset))
    common = ["--config", a.config, "--dataset-uri", ds, "--out", out]
    prep = ["--config", a.config, "--dataset", a.dataset, "--out", out]
    prep += ["--data-dir", a.data_dir] if a.data_dir else []
    stages = [
        ("prepare", prepare_data, prep),
        ("encode", encode_items, common),
        ("train", train_ranker, common),
        ("fit prior", fit_item_prior, common),
        ("analyze KV", analyze_kv, [*common, "--checkpoint", text_ckpt]),
        ("fit pools", train_kv_pool, [*common, "--checkpoint", text_ckpt, "--run", ckv_run]),
        (
            "build states",
            build_user_states,
            [*common, "--checkpoint", storage.join(out, "checkpoints", ckv_run)],
        ),
        # one evaluation gives every row: the ranker from the stored states, its uncompressed
        # base, the prior, the two fused (what serving ranks by) and most-popular
        ("evaluate", evaluate, [*common, "--user-states", states_uri, "--item-prior", prior_uri]),
    ]
    done = []
    for name, module, args in stages:
        done.append(run_stage(name, module.main, module.__name__, args))
        log.info("stage %s done in %.1f s", name, done[-1]["seconds"])
    print("\n== serve: services.app over the stored states", file=sys.stderr, flush=True)
    # serve what evaluate measured through the stored states: the ranker + the prior at its pick
    by = {s["stage"]: s for s in done}
    port = a.port or free_port()
    report = by["evaluate"]["report"]  # names the states, the prior and the weight it measured
    done.append(serve_stage(states_uri, a.load_seconds, a.load_concurrency, port, report))
    reference = full_recipe(a.dataset)
    md = tables(done, reference)
    report = storage.join(out, "reports", "demo")
    storage.write_bytes(storage.join(report, "summary.md"), (md + "\n").encode())
    storage.write_bytes(
        storage.join(report, "summary.json"), json.dumps({"stages": done}, indent=1).encode()
    )
    storage.write_bytes(storage.join(report, "stage_seconds.png"), plot_stages(done))
    print("\n" + md + "\n", file=sys.stderr)
    by = {s["stage"]: s for s in done}
    ev = by["evaluate"]
    summary = {
        "job": "demo",
        "dataset": a.dataset,
        "recipe": a.config,
        "budget": budget(a.config),
        # whether the demo's training budget ended it while validation was still rising
        "train_stopped_by": by["train"].get("stopped_by"),
        "train_val_still_rising": by["train"].get("val_still_rising"),
        "stages": {s["stage"]: s["seconds"] for s in done},
        "ranker_ndcg10": ev.get("uncompressed_full_ndcg10"),
        "ranker_ndcg10_from_states": ev.get("ranker_full_ndcg10"),
        "served_ndcg10": ev.get("ranker_prior_full_ndcg10"),
        "most_popular_ndcg10": ev.get("most_popular_full_ndcg10"),
        "full_recipe_served_ndcg10": (reference or {}).get("ranker_prior_full_ndcg10"),
        "state_ratio": by["build states"]["ratio"],
        "scores_per_s": by["serve"]["load"]["candidate_scores_per_s"],
        "report": report,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0
