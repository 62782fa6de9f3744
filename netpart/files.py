"""File effects at the edge: atomic writes (the bottom floor: it imports nothing of netpart).

Every write goes to a temporary file in the destination directory and is renamed into place,
so a reader never sees a half-written file and a failed run leaves the old file intact.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["foreign_entries", "write_atomic", "write_files"]


def foreign_entries(out_dir: Path, marker: str, forbidden: tuple[str, ...] = ()) -> list[str]:
    """What makes `out_dir` unsafe to write a command's files into: nothing if it is missing,
    empty, or holds `marker` (that command's own output) and none of `forbidden` (another
    command's); else the names found there (at most five), for the refusal."""
    if not out_dir.is_dir():
        return []
    names = sorted(p.name for p in out_dir.iterdir())
    if not names or (marker in names and not set(forbidden) & set(names)):
        return []
    return names[:5]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # name the file: a full disk's error carries no path
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_files(out_dir: Path, files: dict[str, bytes]) -> None:
    """Write every file atomically; all content is prepared before the first write."""
    for name, data in files.items():
        write_atomic(out_dir / name, data)
