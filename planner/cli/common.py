"""What every `autopar` command shares: the user-error type (one line, exit 2) and JSON output."""

from __future__ import annotations

import json
import sys


class UsageError(ValueError):
    """A user-facing error the CLI reports in one line with exit code 2."""


def print_json(obj) -> None:
    """``obj`` as one JSON document on stdout (``--json``: nothing else is printed there)."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
