"""What the text ranker buys on items the interaction log has barely or never seen: a recipe
run on a dataset whose held-out share of the catalog no model trains on.

    python -m benchmarks.cold_start --config configs/ml-latest-small.yaml [--out out/cold_start]
        [--holdout-items 0.1] [--vectors-uri V] [--max-minutes M] [--epochs E]

Runs, every job with ``--config <recipe>``: prepare_data ``--holdout-items`` (10% of the
interacted items, seeded, left in the catalog but out of every history and validation item) ->
encode_items (or ``--vectors-uri``: the catalog's vectors already encoded; the catalog is the
same) -> three rankers: ``text+id`` (the recipe's), ``text`` (item text vectors alone) and
``id`` (learned item ids alone, the id-only baseline) -> fit_item_prior (the new items
borrowing their text neighbours' weights; first, when the recipe's rankers mine negatives
from it) -> evaluate twice with
the prior (text+id beside the id ranker, then text), each over its seeded sample plus the
users whose test item is a new item.

Writes ``benchmarks/results/cold_start_<dataset>.json``: each stage's command line, JSON
summary and wall time, and a table per model - NDCG@10 on new items (standard error), over
the sample, and by the test item's popularity. ``--max-minutes``/``--epochs`` cap each
ranker's training below the recipe's (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import yaml

from benchmarks.report import machine, mines_negatives, write

RANKERS = ("text+id", "text", "id")


def model_table(evals: dict[str, dict]) -> dict:
    """Per model: NDCG@10 on new items (+ standard error), over the sample, and by popularity
    bucket, from the two evaluate summaries ({"text+id": ..., "text": ...})."""
    main, text = evals["text+id"], evals["text"]
    sources = {
        "ranker text+id": (main, "ranker"),
        "ranker text": (text, "ranker"),
        "ranker id": (main, "ranker_id"),
        "item prior": (main, "item_prior"),
        "fused text+id + prior": (main, "ranker_prior"),
        "fused text + prior": (text, "ranker_prior"),
        "most popular": (main, "most_popular"),
    }
    rows = {}
    for label, (ev, m) in sources.items():
        new = ev["new_items"][m]
        rows[label] = {
            "new_ndcg10": round(new["ndcg10"], 4),
            "new_ndcg10_se": round(new["ndcg10_se"], 4),
            "new_hr10": round(new["hr10"], 4),
            "new_hr100": round(new["hr100"], 4),
            "new_median_rank": new["median_rank"],
            "ndcg10": round(ev["metrics"][m]["full"]["ndcg10"], 4),
            "by_popularity": ev["by_item_popularity"]["ndcg10"][m],
        }
    return {
        "new_item_users": main["new_items"]["users"],
        "users": main["users"],
        "popularity_buckets": main["by_item_popularity"]["bucket"],
        "popularity_users": main["by_item_popularity"]["users"],
        "fusion_weight": {"text+id": main["fusion_weight"], "text": text["fusion_weight"]},
        "models": rows,
    }


def main(argv: list[str] | None = None) -> int:
    from artifacts import storage
    from demo import run_stage
    from pipelines import encode_items, evaluate, fit_item_prior, prepare_data, train_ranker
    from pipelines.common import jobs

    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__)
    p.add_argument("--config", required=True, help="a recipe: configs/<dataset>.yaml")
    p.add_argument("--out", default="out/cold_start", help="output root (default: %(default)s)")
    p.add_argument("--holdout-items", type=float, default=0.1, help="(default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="default: $KVRANK_DATA_DIR, ../shared/data")
    p.add_argument("--vectors-uri", default=None, help="the catalog's vectors (skips encoding)")
    p.add_argument("--max-minutes", type=float, default=None, help="cap each ranker's training")
    p.add_argument("--epochs", type=int, default=None, help="cap each ranker's epochs")
    p.add_argument("--json", default=None, help="default: benchmarks/results/cold_start_<ds>.json")
    a = p.parse_args(argv)
    with open(a.config) as fh:
        recipe = yaml.safe_load(fh)
    dataset = recipe["prepare_data"]["dataset"]
    jobs.setup_logging()
    t0 = time.perf_counter()
    out = storage.absolute(a.out)
    ds = storage.join(out, "datasets", dataset)
    common = ["--config", a.config, "--dataset-uri", ds, "--out", out]
    prep = ["--config", a.config, "--out", out, "--holdout-items", str(a.holdout_items)]
    prep += ["--data-dir", a.data_dir] if a.data_dir else []
    done = [run_stage("prepare", prepare_data.main, prepare_data.__name__, prep) | {"argv": prep}]
    vectors = a.vectors_uri
    if not vectors:
        done.append(run_stage("encode", encode_items.main, encode_items.__name__, common))
        vectors = done[-1]["out"]
    cap = (["--max-minutes", str(a.max_minutes)] if a.max_minutes else []) + (
        ["--epochs", str(a.epochs)] if a.epochs else []
    )
    fit = [*common, "--run", f"{dataset}-cold-prior", "--vectors-uri", vectors]

    def fit_prior() -> str:
        stage = run_stage("fit prior", fit_item_prior.main, fit_item_prior.__name__, fit)
        done.append(stage | {"argv": fit})
        return stage["out"]

    # a recipe whose rankers mine negatives from the prior trains after the prior is fitted
    prior = fit_prior() if mines_negatives(recipe) else None
    checkpoints = {}
    for kind in RANKERS:
        run = f"{dataset}-cold-{kind.replace('+', '-')}"
        args = [*common, "--run", run, "--item-input", kind, *cap]
        args += ["--vectors-uri", vectors] if kind != "id" else []
        args += ["--negatives-prior", prior] if prior else []
        done.append(
            run_stage(f"train {kind}", train_ranker.main, train_ranker.__name__, args)
            | {"argv": args}
        )
        checkpoints[kind] = done[-1]["checkpoint"]
    prior = prior or fit_prior()
    evals = {}
    for kind, extra in (("text+id", ["--id-checkpoint", checkpoints["id"]]), ("text", [])):
        args = [*common, "--checkpoint", checkpoints[kind], "--item-prior", prior, *extra]
        args += ["--report", f"{dataset}-cold-{kind.replace('+', '-')}"]
        done.append(
            run_stage(f"evaluate {kind}", evaluate.main, evaluate.__name__, args) | {"argv": args}
        )
        evals[kind] = json.loads(storage.read_file(done[-1]["report"], "metrics.json"))
        evals[kind] |= {"fusion_weight": done[-1].get("fusion_weight")}
    table = model_table(evals)
    path = a.json or f"benchmarks/results/cold_start_{dataset}.json"
    report = {
        "benchmark": "cold_start",
        "dataset": dataset,
        "recipe": a.config,
        "holdout_items": a.holdout_items,
        "training_cap": {"max_minutes": a.max_minutes, "epochs": a.epochs},
        "date": time.strftime("%Y-%m-%d"),
        "table": table,
        "stages": done,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    write(path, report)
    print(
        json.dumps(
            {
                "benchmark": "cold_start",
                "dataset": dataset,
                "new_item_users": table["new_item_users"],
                **{f"{m} new HR@100": r["new_hr100"] for m, r in table["models"].items()},
                "json": path,
                "seconds": report["seconds"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
