"""Writing output files: whole or not at all (plan files, emitted scripts, reports, recalibrated clusters)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, so no half-written file remains.

    A missing folder is the caller's input error: `ValueError` (the CLI reports it in one line, exit 2)."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise ValueError(f"cannot write {path}: folder {path.parent} does not exist; create it or choose another path")
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; an output file is as readable as any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
