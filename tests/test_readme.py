"""The README is a short manual whose results tables are rendered from the committed JSON, and
benchmarks/results/ holds only the files those tables come from."""

from __future__ import annotations

import pathlib

from benchmarks import readme

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_tables_are_the_committed_results(monkeypatch):
    used = []
    load = readme.load
    monkeypatch.setattr(readme, "load", lambda name: used.append(name) or load(name))
    text = (ROOT / "README.md").read_text()
    assert readme.rendered_readme(text) == text, "run python -m benchmarks.readme"
    on_disk = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert on_disk == set(used), "benchmarks/results/ should hold only what the tables use"


def test_the_readme_is_a_manual_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)


def test_the_readme_links_resolve():
    import re

    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)", text):
        assert (ROOT / target).exists(), target
