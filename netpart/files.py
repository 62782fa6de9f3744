"""File effects at the edge: atomic writes (the bottom floor: it imports nothing of netpart).

Every write goes to a temporary file in the destination directory and is renamed into place,
so a reader never sees a half-written file and a failed run leaves the old file intact.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import tempfile
import time
from pathlib import Path

__all__ = ["foreign_entries", "is_temporary", "open_append", "write_atomic", "write_files"]

# `write_atomic`'s temporary files: ".NAME.RANDOM.tmp" beside NAME
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")


def is_temporary(name: str) -> bool:
    """Whether `name` is one of `write_atomic`'s temporary files (a killed command's leftover
    where no writer is running)."""
    return _TEMPORARY.match(name) is not None


def foreign_entries(out_dir: Path, marker: str, forbidden: tuple[str, ...] = ()) -> list[str]:
    """What makes `out_dir` unsafe to write a command's files into: nothing if it is missing,
    empty, or holds `marker` (that command's own output) and none of `forbidden` (another
    command's); else the names found there (at most five), for the refusal."""
    if not out_dir.is_dir():
        return []
    names = sorted(p.name for p in out_dir.iterdir() if not is_temporary(p.name))
    if not names or (marker in names and not set(forbidden) & set(names)):
        return []
    return names[:5]


_UMASK = os.umask(0)  # read once: os.umask can only be read by setting it
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename (the
    file gets the permissions the umask gives a new file, as `open` would). Temporary files
    of `path` that a killed writer left, older than this write, are swept once it is done.
    Every error names `path`, never the temporary file."""
    if path.is_dir():
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    started = time.time()
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
        if exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sweep(path, before=started)


def _sweep(path: Path, before: float) -> None:
    """Remove `path`'s temporary files last modified before `before` (a killed writer's)."""
    for left in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        m = _TEMPORARY.match(left.name)
        try:
            if m and m["name"] == path.name and left.lstat().st_mtime < before:
                left.unlink()
        except OSError:  # gone already, or not ours to remove
            continue


def write_files(out_dir: Path, files: dict[str, bytes]) -> None:
    """Write every file atomically; all content is prepared before the first write."""
    for name, data in files.items():
        write_atomic(out_dir / name, data)


def open_append(path: Path, *, lines: bool = False) -> int:
    """A descriptor that appends to `path` (made if missing), never through a symbolic link
    (OSError ELOOP: a run directory's files are its own). With `lines` (a file of one record
    a line), a torn last line a killed writer left is cut off first, so the next line
    starts a line of its own."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if lines:
            _cut_torn_line(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _cut_torn_line(fd: int) -> None:
    """Truncate the file behind `fd` after its last newline, if it does not end in one."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        if end == size and chunk.endswith(b"\n"):
            return
        at = chunk.rfind(b"\n")
        if at >= 0:
            os.ftruncate(fd, start + at + 1)
            return
        end = start
    os.ftruncate(fd, 0)
