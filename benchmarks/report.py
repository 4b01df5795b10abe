"""What every benchmark shares: the machine it ran on, and writing its JSON report."""

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
