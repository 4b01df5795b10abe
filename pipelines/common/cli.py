"""The one converter between the typed configs, the jobs' command lines and recipe files.

Every job builds its parser with ``job_parser`` and parses with ``parse``:

- a config dataclass's fields become options with ``add_fields`` (``--epochs``, ``--lr``, ...;
  the help line is the field's ``metadata["help"]``, booleans get ``--x`` / ``--no-x``), and
  ``from_args`` builds the dataclass back from the parsed options;
- every option shows its default in ``--help``;
- ``--config FILE`` reads a recipe (YAML, ``configs/*.yaml``): the section named after the job
  sets that job's options, and what the command line gives overrides it. A key the job does not
  have, or a value its option would reject, is an ``InputError`` naming the file, the section
  and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from models.config import field_type
from models.errors import InputError

C = TypeVar("C")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help line (unless the line already says it); the
    description kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def job_parser(job: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m pipelines.<job>``, with ``--config``."""
    p = argparse.ArgumentParser(
        prog=f"python -m pipelines.{job}",
        description=(doc or "").split("\n")[0],
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"a recipe (YAML, e.g. configs/demo.yaml): its '{job}:' section sets this job's "
        "options; options given on the command line override it",
    )
    p.set_defaults(_job=job)
    return p


def _metadata(cls: type, name: str) -> Any:
    """A field's metadata, from the nearest class that gave it one (a subclass that only
    changes a default keeps the base's help line)."""
    for klass in cls.__mro__:
        for f in dataclasses.fields(klass) if dataclasses.is_dataclass(klass) else ():
            if f.name == name and f.metadata:
                return f.metadata
    return {}


def add_fields(
    p: argparse.ArgumentParser,
    cls: type,
    title: str,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """One option per field of the dataclass ``cls`` (or of the fields in ``only``)."""
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        meta = _metadata(cls, f.name)
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name} has no help line (field metadata 'help')")
        flag = f"--{f.name.replace('_', '-')}"
        kind = field_type(cls, f.name)
        kw: dict[str, Any] = {"default": f.default, "help": meta["help"], "dest": f.name}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if "choices" in meta:
                kw["choices"] = meta["choices"]
        g.add_argument(flag, **kw)


def from_args(a: argparse.Namespace, cls: type[C], **values: Any) -> C:
    """``cls`` from the parsed options named after its fields; ``values`` fill the others."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in values and hasattr(a, f.name):
            values[f.name] = getattr(a, f.name)
    return cls(**values)


def read_recipe(path: str, job: str) -> dict[str, Any]:
    """The ``job`` section of the recipe file ``path`` ({} when it has none)."""
    import yaml

    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except OSError as e:
        raise InputError(f"--config {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise InputError(f"--config {path}: not valid YAML ({e})") from e
    if not isinstance(doc, dict) or not all(isinstance(v, dict | None) for v in doc.values()):
        raise InputError(f"--config {path}: expected a mapping of job name -> options")
    section = doc.get(job) or {}
    return {str(k).replace("-", "_"): v for k, v in section.items()}


def _as_text(value: Any) -> str:
    """A recipe value as the command line would give it (lists as comma lists)."""
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A job's options: ``argv`` over the recipe's; a bad recipe ends the process with one line
    naming what is wrong (exit 2, as for a bad option)."""
    try:
        return parse_with_recipe(p, argv)
    except InputError as e:
        p.exit(2, f"error: {e}\n")


def parse_with_recipe(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` over the defaults of the recipe named by ``--config`` (if any)."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config")
    pre, _ = first.parse_known_args(argv)
    if pre.config:
        job = p.get_default("_job")
        actions = {a.dest: a for a in p._actions if a.option_strings}
        for key, value in read_recipe(pre.config, job).items():
            where = f"--config {pre.config}, section {job}: {key}"
            action = actions.get(key)
            if action is None or key == "config":
                raise InputError(f"{where}: {job} has no option --{key.replace('_', '-')}")
            if action.nargs == 0:  # a flag: true or false
                if not isinstance(value, bool):
                    raise InputError(f"{where}: must be true or false, got {value!r}")
                converted: Any = value
            elif value is None:
                converted = None
            else:
                try:
                    converted = (action.type or str)(_as_text(value))
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    raise InputError(f"{where}: {value!r} is not valid ({e})") from e
                if action.choices is not None and converted not in action.choices:
                    choices = ", ".join(map(str, action.choices))
                    raise InputError(f"{where}: {value!r} is not one of {choices}")
            action.default = converted
            action.required = False  # the recipe gave it
    return p.parse_args(argv)
