"""Emulated CPUs: a cgroup (v1 cpu controller) per emulated machine, with a fixed share of a core.

`cpu_shares(n, share)` makes n cgroups under /sys/fs/cgroup/cpu, each limited by CFS bandwidth
control to `share` of one core (`cpu.cfs_quota_us` / `cpu.cfs_period_us`; the period is as
short as a 1 ms quota allows, so a throttled process waits a few ms at most); `whole_cores(n)`
makes n cpuset groups instead, each pinned to one core of its own. On exit either kills
whatever still runs in them and removes them; it first removes the groups of an earlier run
whose process is gone (`remove_stale`: SIGKILL leaves no chance to). `command(group, argv)`
runs argv inside a group (wrap `netns.Host.command` in it, not the other way round:
`ip netns exec` mounts the namespace's own /sys over the cgroups). Needs root;
`unavailable()` says why it cannot be used here, for a skip.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

CPU = Path("/sys/fs/cgroup/cpu")
CPUSET = Path("/sys/fs/cgroup/cpuset")
MIN_QUOTA_US = 1000  # the kernel's smallest CFS quota
OURS = re.compile(r"netpart-(\d+)-\d+")  # netpart-<pid>-<machine>


def unavailable() -> str | None:
    """Why cpu cgroups cannot be made here, or None."""
    if not (CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU} (CFS bandwidth control)"
    probe = CPU / f"netpart-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create cpu cgroups in {CPU} ({exc.strerror}); needs root"
    return None


def period_us(share: float) -> int:
    """The shortest CFS period whose quota for `share` is at least the kernel's 1 ms."""
    return max(MIN_QUOTA_US, math.ceil(MIN_QUOTA_US / share))


@contextlib.contextmanager
def cpu_shares(n: int, share: float) -> Iterator[list[Path]]:
    """`n` cgroups, each held to `share` (0 < share <= 1) of one core."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], not {share}")
    remove_stale()
    groups = [CPU / f"netpart-{os.getpid()}-{i}" for i in range(n)]
    made: list[Path] = []
    try:
        for group in groups:
            make_group(group, share)
            made.append(group)
        yield groups
    finally:
        remove(made)


@contextlib.contextmanager
def whole_cores(n: int) -> Iterator[list[Path]]:
    """`n` cpuset cgroups, group i pinned to core i alone: a dedicated core per machine, the
    reference a quota's emulation is judged against (no throttling; needs n cores)."""
    cores = os.sched_getaffinity(0)
    if n > len(cores):
        raise ValueError(f"{n} whole cores asked for, this process may use {len(cores)}")
    remove_stale()
    groups = [CPUSET / f"netpart-{os.getpid()}-{i}" for i in range(n)]
    made: list[Path] = []
    try:
        mems = (CPUSET / "cpuset.mems").read_text().strip()
        for group, core in zip(groups, sorted(cores), strict=False):
            group.mkdir()
            made.append(group)
            (group / "cpuset.cpus").write_text(str(core))
            (group / "cpuset.mems").write_text(mems)
        yield groups
    finally:
        remove(made)


def make_group(group: Path, share: float) -> None:
    """Create cgroup `group` held to `share` of one core."""
    period = period_us(share)
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(round(period * share)))


def remove_stale() -> list[Path]:
    """Remove the groups `cpu_shares` made for a process that no longer runs (the pid in the
    name); returns them."""
    stale = [
        g
        for root in (CPU, CPUSET)
        if root.is_dir()
        for g in root.iterdir()
        if (m := OURS.fullmatch(g.name)) and not Path(f"/proc/{m.group(1)}").exists()
    ]
    remove(stale)
    return stale


def command(group: Path, argv: list[str]) -> list[str]:
    """`argv` run inside `group` (the shell joins it, then becomes argv)."""
    join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    return ["sh", "-c", join, str(group), *argv]


def remove(groups: list[Path]) -> None:
    """Kill every process left in each group, then remove the group."""
    kill_inside(groups)
    for group in groups:
        with contextlib.suppress(OSError):
            group.rmdir()


def kill_inside(groups: list[Path]) -> None:
    """Kill every process in each group (and those they start meanwhile); the groups stay."""
    for group in groups:
        for _ in range(50):
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
