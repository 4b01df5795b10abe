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


def test_the_new_items_table_is_rendered_from_a_cold_start_run(tmp_path, monkeypatch):
    """benchmarks.cold_start's table, from its two evaluate reports, as the README shows it."""
    import json

    from benchmarks.cold_start import model_table

    def report(models: list[str], weight: float) -> dict:
        buckets = {"bucket": ["0", "1-4"], "users": [3, 7]}
        new = {"users": 3}
        new |= {
            m: dict(ndcg10=0.1, hr10=0.2, ndcg10_se=0.01, hr100=0.5, median_rank=40.0)
            for m in models
        }
        return {
            "users": 10,
            "metrics": {m: {"full": {"ndcg10": 0.3}} for m in models},
            "new_items": new,
            "by_item_popularity": buckets | {"ndcg10": {m: [0.0, 0.4] for m in models}},
            "fusion_weight": weight,
        }

    both = ["ranker", "item_prior", "ranker_prior", "most_popular"]
    table = model_table({"text+id": report([*both, "ranker_id"], 50.0), "text": report(both, 20.0)})
    assert len(table["models"]) == 7 and table["fusion_weight"] == {"text+id": 50.0, "text": 20.0}
    assert table["models"]["ranker id"]["new_hr100"] == 0.5
    stages = [{"stage": f"train {k}", "item_input": k, "epochs_run": 3} for k in ("text+id", "id")]
    monkeypatch.setattr(readme, "RESULTS", tmp_path)
    assert readme.cold_start() == []  # nothing measured: no section
    for ds, cap in (("ml-latest-small", None), ("amazon-videogames-2018", 2)):
        prior = {"stage": "fit prior", "borrowed_items": 1705 if cap else 0}
        (tmp_path / f"cold_start_{ds}.json").write_text(
            json.dumps(
                {
                    "table": table,
                    "stages": [*stages, prior],
                    "recipe": f"configs/{ds}.yaml",
                    "date": "2026-12-06",
                    "holdout_items": 0.1,
                    "training_cap": {"max_minutes": None, "epochs": cap},
                }
            )
        )
    lines = readme.cold_start()
    assert lines[0].startswith("| ml-latest-small: model | new items (3 users): NDCG@10 | HR@100")
    assert "| ranker id | 0.1000 ± 0.0100 | 0.500 | 40 | 0.3000 | 0.0000 | 0.4000 |" in lines
    assert not [ln for ln in lines if ln.startswith("| most popular")]  # left in the JSON
    # a table per dataset, then one caption naming each run
    second = lines.index("") + 1
    assert lines[second].startswith("| amazon-videogames-2018: model | new items (3 users)")
    assert lines[-2] == "" and lines.count("") == 2
    assert "(2026-12-06; 10% of the items held out; epochs trained: text+id 3, id 3)" in lines[-1]
    # a run whose prior lent new items their text neighbours' weights says how many
    assert (
        "epochs trained: text+id 3, id 3, capped at 2 epochs; 1,705 items without interactions "
        "borrowing the prior's weights of their nearest items by text)" in lines[-1]
    )
