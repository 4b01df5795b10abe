"""What every job shares: progress logging to stderr, the one-line JSON summary on stdout, and
the rule that bad input or an unreachable URI ends the job with a one-line error and exit 2."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from artifacts import storage
from models.errors import InputError

EXPECTED_ERRORS = (InputError, storage.StorageError)


def setup_logging() -> None:
    """Progress lines from kvrank's loggers on stderr; third-party libraries stay at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("kvrank")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def run(job: Callable[[], dict[str, Any]]) -> int:
    """Run ``job``; print its summary as one JSON line, or the error as one line on stderr."""
    setup_logging()
    try:
        summary = job()
    except EXPECTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0
