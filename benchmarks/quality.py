"""The README's quality table, reproduced from a recipe: prepare -> encode -> train the ranker
-> fit the item prior -> evaluate (the ranker, the prior, the two fused, most-popular), every
job run with ``--config <recipe>``.

    python -m benchmarks.quality --config configs/ml-latest-small.yaml [--out out]
        [--complementary] [--dataset-uri D --vectors-uri V]

A recipe whose ranker mines negatives from the prior (``train_ranker: prior_negatives``) fits
the prior first and trains with it as ``--negatives-prior``. ``--complementary`` fits the prior
first and trains the ranker complementary to it
(``train_ranker --item-prior``: evaluate fuses at the weight it learned) and writes
``quality_<dataset>_complementary.json``; ``--dataset-uri``/``--vectors-uri`` start from a
prepared dataset and its vectors (no prepare or encode stage).

Writes ``benchmarks/results/quality_<dataset>.json``: each job's command line, JSON summary and
wall time, the machine, and the date; ``benchmarks.readme`` renders the README's table from
it. The jobs run in this process on one embedded Ray, as ``make demo`` runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import yaml

from benchmarks.report import machine, mines_negatives, write

# the reference figures the issue set for each dataset (SASRec's runs on the same protocol,
# full-catalog NDCG@10) and the quality targets
REFERENCES = {
    "ml-latest-small": {"target_ndcg10": 0.070, "sasrec_ndcg10": 0.059, "sasrec_hr10": 0.112},
    "amazon-videogames-2018": {
        "target_ndcg10": 0.065,
        "sasrec_ndcg10": 0.058,
        "sasrec_hr10": 0.103,
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__)
    p.add_argument("--config", required=True, help="a recipe: configs/<dataset>.yaml")
    p.add_argument("--out", default="out", help="output root (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="default: $KVRANK_DATA_DIR, ../shared/data")
    p.add_argument("--json", default=None, help="default: benchmarks/results/quality_<ds>.json")
    p.add_argument(
        "--complementary", action="store_true", help="train the ranker with --item-prior"
    )
    p.add_argument("--dataset-uri", default=None, help="a prepared dataset (skips prepare)")
    p.add_argument("--vectors-uri", default=None, help="its item vectors (skips encode)")
    return p


def main(argv: list[str] | None = None) -> int:
    from artifacts import storage
    from demo import run_stage
    from pipelines.common import jobs

    p = build_parser()
    a = p.parse_args(argv)
    if bool(a.dataset_uri) != bool(a.vectors_uri):
        p.error("--dataset-uri and --vectors-uri go together")
    with open(a.config) as fh:
        recipe = yaml.safe_load(fh)
    dataset = recipe["prepare_data"]["dataset"]
    jobs.setup_logging()
    t0 = time.perf_counter()
    stages = plan(a, recipe, storage.absolute(a.out))
    done = []
    for name, module, args in stages:
        done.append(run_stage(name, module.main, module.__name__, args) | {"argv": args})
    suffix = "_complementary" if a.complementary else ""
    path = a.json or f"benchmarks/results/quality_{dataset}{suffix}.json"
    report = {
        "benchmark": "quality",
        "dataset": dataset,
        "recipe": a.config,
        "complementary": a.complementary,
        "inputs": {"dataset_uri": a.dataset_uri, "vectors_uri": a.vectors_uri},
        "date": time.strftime("%Y-%m-%d"),
        "references": REFERENCES.get(dataset, {}),
        "stages": done,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    write(path, report)
    ev = done[-1]
    print(
        json.dumps(
            {
                "benchmark": "quality",
                "dataset": dataset,
                **{k: v for k, v in ev.items() if k.endswith("_full_ndcg10")},
                "fusion_weight": ev.get("fusion_weight"),
                "json": path,
                "seconds": report["seconds"],
            }
        )
    )
    return 0


def plan(a: argparse.Namespace, recipe: dict, out: str) -> list[tuple[str, object, list[str]]]:
    """The recipe's jobs in order, each (stage, job module, its command line): the prior first
    when the ranker trains on the fused score (``--complementary``) or mines negatives from it
    (the recipe's ``prior_negatives``); evaluate fuses a complementary ranker at the weight it
    learned, any other at the weight it picks."""
    from artifacts import storage
    from pipelines import encode_items, evaluate, fit_item_prior, prepare_data, train_ranker

    dataset = recipe["prepare_data"]["dataset"]
    ds = a.dataset_uri or storage.join(out, "datasets", dataset)
    run = f"{dataset}-recipe" + ("-complementary" if a.complementary else "")
    checkpoint = storage.join(out, "checkpoints", run)
    prior = storage.join(out, "item_priors", dataset, f"{dataset}-recipe-prior")
    common = ["--config", a.config, "--dataset-uri", ds, "--out", out]
    prep = ["--config", a.config, "--out", out] + (["--data-dir", a.data_dir] if a.data_dir else [])
    train = [*common, "--run", run] + (["--vectors-uri", a.vectors_uri] if a.vectors_uri else [])
    train += ["--item-prior", prior] if a.complementary else []
    mines = mines_negatives(recipe)
    train += ["--negatives-prior", prior] if mines else []
    fit = ("fit prior", fit_item_prior, [*common, "--run", f"{dataset}-recipe-prior"])
    trained = ("train", train_ranker, train)
    stages = (
        [] if a.dataset_uri else [("prepare", prepare_data, prep), ("encode", encode_items, common)]
    )
    stages += [fit, trained] if a.complementary or mines else [trained, fit]
    fuse = [] if a.complementary else ["--item-prior", prior]
    return stages + [("evaluate", evaluate, [*common, "--checkpoint", checkpoint, *fuse])]


if __name__ == "__main__":
    sys.exit(main())
