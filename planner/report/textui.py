"""Tables for the terminal: rich when stdout is a terminal, plain aligned text otherwise (pipes, files, tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], *,
                 right: Sequence[bool] | None = None, file=None) -> None:
    file = file or sys.stdout
    right = right or [i > 0 for i in range(len(headers))]
    cells = [[str(c) for c in row] for row in rows]
    if file.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for h, r in zip(headers, right):
            table.add_column(h, justify="right" if r else "left")
        for row in cells:
            table.add_row(*row)
        Console(file=file).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(vals):
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(vals, widths, right)).rstrip()

    if title:
        print(title, file=file)
    print(line(headers), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float, unit: str = "") -> str:
    for suffix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"
