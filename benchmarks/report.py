"""What every benchmark shares: the machine it ran on, writing its JSON report, and what a
recipe asks of the order of its jobs."""

from __future__ import annotations

import json
import os
import platform

import torch


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def write(path: str, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path``, creating its folder. The file is replaced
    whole (written beside it, then renamed), so a run killed while writing leaves the last
    complete report, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)


def mines_negatives(recipe: dict) -> bool:
    """Whether a recipe's ranker mines negatives from the item prior (``train_ranker:
    prior_negatives``): a benchmark running it fits the prior first and passes it as
    ``--negatives-prior``."""
    return bool((recipe.get("train_ranker") or {}).get("prior_negatives"))
