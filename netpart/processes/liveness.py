"""What a launcher can tell about its processes from outside them, and the private temporary
directories of its jobs.

- `is_stopped(pid)`: the process is stopped (SIGSTOP, a debugger): it holds its connections
  open and answers nothing, so its peers see it only when their timeouts run out; the
  launcher reads it from /proc and names it.
- `mark_joined` / `joined`: a process of a local job leaves a marker next to the job's file
  store once it has joined the process group. Until every process has, the job is starting,
  and a process that dies then takes the whole job down (the others wait in the rendezvous).
- `private_tmpdir`: a job's temporary directory, named with the launcher's pid; a directory
  of a launcher that no longer runs (killed by SIGKILL: nothing could remove it) is removed
  by the next job (`sweep_stale`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "is_stopped",
    "job_pss",
    "joined",
    "mark_joined",
    "private_tmpdir",
    "pss",
    "sweep_stale",
]

_TMP = re.compile(r"netpart-(store|job)-(\d+)-")


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rfind(")") + 2 : text.rfind(")") + 3] in ("T", "t")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def pss(pid: int) -> int:
    """Bytes process `pid` holds, its shared pages divided among the processes sharing them
    (Pss in /proc/PID/smaps_rollup: forked processes share their parent's pages); 0 if it
    is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def job_pss(marker: bytes) -> int:
    """Bytes held (`pss`) by the processes a netpart zygote forked whose environment holds
    `marker` (a variable set for one job, which they inherit): a job's memory, measured from
    outside it."""
    parents: dict[int, int] = {}
    zygotes: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes():
                continue
            if b"netpart.processes.zygote" in (entry / "cmdline").read_bytes():
                zygotes.add(int(entry.name))
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    return sum(pss(pid) for pid, ppid in parents.items() if ppid in zygotes)


def mark_joined(store: str, rank: int, stage: str = "joined") -> None:
    """Leave this process's marker of `stage` (arrived at the rendezvous, or joined the
    group) beside the job's file store `store`."""
    Path(f"{store}.{stage}{rank}").touch()


def joined(store: str, world: int) -> int:
    """How many of the job's `world` processes have left their joined-marker."""
    return sum(Path(f"{store}.joined{rank}").exists() for rank in range(world))


def sweep_stale() -> int:
    """Remove the temporary directories of netpart launchers that no longer run; how many."""
    removed = 0
    root = Path(tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for entry in entries:
        m = _TMP.match(entry.name)
        if m and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def private_tmpdir(kind: str) -> str:
    """A new private temporary directory for this launcher's job (`kind`: store or job),
    after removing those of launchers that are gone."""
    sweep_stale()
    return tempfile.mkdtemp(prefix=f"netpart-{kind}-{os.getpid()}-")
