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


_UMASK = os.umask(0)  # read once: os.umask can only be read by setting it
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename (the
    file gets the permissions the umask gives a new file, as `open` would)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:  # name the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
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
