"""The jobs' command lines: generated from the typed configs, every option explained with its
default, recipes (configs/*.yaml) read as defaults the command line overrides, bad recipes
refused with the file, section and key named."""

from __future__ import annotations

import argparse
import importlib
import pathlib

import pytest

from models.config import RankerConfig
from models.errors import InputError
from pipelines.common import cli
from pipelines.common.ranker_training import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOBS = sorted(p.stem for p in (ROOT / "pipelines").glob("*.py") if p.stem != "__init__")
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


class _Parser(Exception):
    pass


def job_parser(job: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``pipelines.<job>.main`` builds (caught as it is about to parse)."""

    def caught(p, argv):
        raise _Parser(p)

    module = importlib.import_module(f"pipelines.{job}")
    with monkeypatch.context() as m:
        m.setattr(cli, "parse", caught)
        with pytest.raises(_Parser) as got:
            module.main([])
    return got.value.args[0]


def required_argv(p: argparse.ArgumentParser, given=()) -> list[str]:
    """Placeholder values for the required options that ``given`` does not name."""
    needed = [a for a in p._actions if a.required and a.dest not in given]
    return [x for a in needed for x in (a.option_strings[0], "x")]


@pytest.mark.parametrize("job", JOBS)
def test_every_option_says_what_it_does_and_its_default(job, monkeypatch):
    p = job_parser(job, monkeypatch)
    text = p.format_help()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 3
    for a in options:
        assert a.help, f"{job} {a.option_strings[0]} has no help line"
        shown = p._get_formatter()._get_help_string(a)
        assert a.required or "default" in shown, f"{job} {a.option_strings[0]}: no default shown"
    assert "--config FILE" in text


def test_defaults_are_the_measured_recipe(monkeypatch):
    """The README's quality table is for text+id with dot-product validation: the plain command
    must train exactly that, and the CLI's ranker shape is RankerConfig's own."""
    p = job_parser("train_ranker", monkeypatch)
    a = p.parse_args(["--dataset-uri", "d", "--out", "o"])
    from pipelines.train_ranker import configs_from_args

    rc, tc = configs_from_args(a, feedback_classes=5)
    assert rc == RankerConfig(feedback_classes=5)
    assert rc.item_input == "text+id" and tc.val_score == "dot"
    assert tc == TrainConfig()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_name_real_jobs_and_options(recipe, monkeypatch):
    import yaml

    sections = yaml.safe_load(recipe.read_text())
    assert sections and set(sections) <= set(JOBS), f"{recipe.name}: unknown job section"
    for job in sections:
        p = job_parser(job, monkeypatch)
        a = cli.parse_with_recipe(p, ["--config", str(recipe), *required_argv(p, sections[job])])
        for key, value in sections[job].items():
            got, listed = getattr(a, key), value if isinstance(value, list) else [value]
            assert got == value or list(got) == listed, (recipe.name, job, key)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_command_line_overrides_the_recipe(tmp_path, monkeypatch):
    p = job_parser("train_ranker", monkeypatch)
    recipe = write(tmp_path, "train_ranker:\n  epochs: 7\n  lr: 0.01\n  ema-decay: 0\n")
    a = cli.parse_with_recipe(
        p, ["--config", recipe, "--dataset-uri", "d", "--out", "o", "--epochs", "2"]
    )
    assert (a.epochs, a.lr, a.ema_decay) == (2, 0.01, 0.0)
    assert isinstance(a.lr, float) and isinstance(a.epochs, int)


def test_recipe_may_give_required_paths_and_flags(tmp_path, monkeypatch):
    p = job_parser("train_ranker", monkeypatch)
    recipe = write(tmp_path, "train_ranker:\n  dataset_uri: d\n  out: o\n  use_gpu: true\n")
    a = cli.parse_with_recipe(p, ["--config", recipe])
    assert (a.dataset_uri, a.out, a.use_gpu) == ("d", "o", True)
    assert cli.parse_with_recipe(p, ["--config", recipe, "--no-use-gpu"]).use_gpu is False


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("train_ranker:\n  epoch: 3\n", "train_ranker has no option --epoch"),
        ("train_ranker:\n  epochs: many\n", "epochs: 'many' is not valid"),
        ("train_ranker:\n  item_input: words\n", "'words' is not one of text, id, text+id"),
        ("train_ranker:\n  use_gpu: 1\n", "use_gpu: must be true or false"),
        ("train_ranker: [1, 2]\n", "expected a mapping of job name -> options"),
        ("train_ranker:\n  epochs: [\n", "not valid YAML"),
    ],
)
def test_bad_recipes_name_file_section_and_key(text, named, tmp_path, monkeypatch):
    p = job_parser("train_ranker", monkeypatch)
    recipe = write(tmp_path, text)
    with pytest.raises(InputError, match="recipe.yaml") as e:
        cli.parse_with_recipe(p, ["--config", recipe, "--dataset-uri", "d", "--out", "o"])
    assert named in str(e.value)


def test_missing_recipe_is_an_input_error(monkeypatch):
    p = job_parser("evaluate", monkeypatch)
    with pytest.raises(InputError, match="no-such.yaml"):
        cli.parse_with_recipe(p, ["--config", "no-such.yaml", "--dataset-uri", "d", "--out", "o"])


def test_a_recipe_error_ends_the_job_with_one_line(tmp_path, capsys):
    from pipelines import train_ranker

    recipe = write(tmp_path, "train_ranker:\n  epoch: 3\n")
    with pytest.raises(SystemExit) as e:
        train_ranker.main(["--config", recipe, "--dataset-uri", "d", "--out", "o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err == [
        f"error: --config {recipe}, section train_ranker: epoch: train_ranker has no option --epoch"
    ]


def test_one_converter_types_text_for_every_config():
    """Serve's args, JSON beside an artifact and recipes go through models.config.typed_values."""
    from models.config import CollectiveKVConfig, typed_values
    from services.settings import ServeSettings

    got = typed_values(ServeSettings, {"shards": "3", "item_prior_weight": "0.5", "store_uri": 7})
    assert got == {"shards": 3, "item_prior_weight": 0.5, "store_uri": "7"}
    assert typed_values(CollectiveKVConfig, {"share_k": "False"}) == {"share_k": False}
    with pytest.raises(InputError, match="share_v: 'maybe' is not true or false"):
        typed_values(CollectiveKVConfig, {"share_v": "maybe"})
    with pytest.raises(InputError, match=r"RankerConfig: unknown field\(s\) width"):
        RankerConfig.from_dict({"width": 3})
    assert RankerConfig.from_dict(RankerConfig().to_dict()) == RankerConfig()
