"""A run directory has one owner at a time: the job that trains in it holds an exclusive
`flock` on the directory itself for the job's life (the launcher on one machine; under
torchrun the first shard, which writes the run files). The lock is on the directory's own
file descriptor, so no file is added to it; the kernel drops it when the holder exits,
however it exits. A second job on the same directory is refused in one line naming the
holder's pid (read from /proc/locks)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from netpart.errors import TrainError

__all__ = ["RunLock", "holder"]


def holder(run: Path) -> int | None:
    """The pid holding a flock on directory `run` (from /proc/locks), or None."""
    try:
        st = os.stat(run)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF" (a "->" marks a waiter)
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5].lower() == want:
            return int(fields[4])
    return None


class RunLock:
    """Hold run directory `run` (created if missing) for a `with` block; TrainError, one
    line, if another job holds it."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.run.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = holder(self.run)
            who = f"netpart pid {pid}" if pid is not None else "another netpart job"
            raise TrainError(
                f"{self.run}: in use by {who}, which trains in it now; wait for it to end (or "
                "stop it), or choose another --out directory"
            ) from None
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
