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


def _number(kind, low: float, inclusive: bool, what: str):
    """An argparse ``type`` that accepts a ``kind`` number above ``low`` (at or above when ``inclusive``): argparse
    turns its error into one usage line and exit 2."""
    import argparse
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


#: argparse types for counts and durations
positive_int = _number(int, 1, True, "an integer ≥ 1")
count = _number(int, 0, True, "an integer ≥ 0")
positive_float = _number(float, 0.0, False, "a number > 0")


def fraction(text: str) -> float:
    """An argparse ``type``: a number in (0, 1]."""
    import argparse

    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value
