"""TEST-ONLY fault injection: one hook, one grammar, read from `NETPART_TEST_FAULT`.

Tests make a process of a job die, hang or slow down at a chosen point, to prove that the
job still ends (and ends the way the docs say). Unset, every call here returns at once.

Grammar: comma-separated entries `ACTION:RANK[@N]`

    die:1          rank 1 exits with code 17 at its point 0 (N defaults to 0)
    die:3@9        rank 3 exits with code 17 at its point 9
    hang:2         rank 2 sleeps for an hour at its point 0
    slow:1@0.4     rank 1 sleeps 0.4 s at every point (a slow machine)
    enospc:4@2     rank 4's checkpoint write number 2 fails with "No space left on device"
    forge:1@0      rank 1's group probe number 0 carries a wrong token (a stranger's bytes)
    mute:2@1       rank 2 does not answer its group probe number 1 (a pair a stranger took)

What a point is depends on the role: a model worker of `run`/`check` reaches point 0 once it
is built; every training process reaches point -1 before it joins the job's group and -2
once it has, before its first exchange (start-up); a
training worker reaches point t before step t (point 0 before the first); a
parameter-server shard reaches point n after its n-th update; a Sandblaster worker reaches a
point before each work unit; a host following `netpart calibrate` under torchrun reaches
point n before its n-th command from rank 0. `enospc` counts checkpoint writes instead (the
first is 1); `forge` and `mute` count the group probes a process makes as its groups form
(`netpart.processes.groups`; the job's default group's first probe is 0).

Faults fire in a job's first attempt only: not in processes restarted after a failure
(`NETPART_RESTART` or torchrun's `TORCHELASTIC_RESTART_COUNT` above 0), so a test can kill a
shard once and watch the job recover.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from dataclasses import dataclass

__all__ = [
    "ENV",
    "EXIT_CODE",
    "RESTART_ENV",
    "Fault",
    "active",
    "forged",
    "muted",
    "parse",
    "point",
    "restarted",
    "write_fails",
]

ENV = "NETPART_TEST_FAULT"
log = logging.getLogger(__name__)

RESTART_ENV = "NETPART_RESTART"  # set by the launcher: which restart of the job this is
EXIT_CODE = 17
ACTIONS = ("die", "hang", "slow", "enospc", "forge", "mute")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    at: float = 0.0


@functools.lru_cache(maxsize=8)
def parse(text: str) -> tuple[Fault, ...]:
    """The faults a `NETPART_TEST_FAULT` value names; ValueError for anything else."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        action, _, where = entry.partition(":")
        rank, _, at = where.partition("@")
        if action not in ACTIONS or not rank.strip().isdigit():
            raise ValueError(f"{ENV}={text!r}: expected ACTION:RANK[@N] with ACTION in {ACTIONS}")
        out.append(Fault(action, int(rank), float(at) if at else 0.0))
    return tuple(out)


def _mine(rank: int, action: str) -> list[Fault]:
    text = os.environ.get(ENV)
    if not text or restarted():
        return []
    return [f for f in parse(text) if f.rank == rank and f.action == action]


def restarted() -> bool:
    """Whether this process belongs to a restart of its job (not the first attempt)."""
    counts = (os.environ.get(v, "0") for v in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"))
    return any(c.strip() not in ("", "0") for c in counts)


def active(rank: int) -> bool:
    """Whether any fault is set for rank `rank` (in this attempt)."""
    if ENV not in os.environ:
        return False
    return any(_mine(rank, action) for action in ACTIONS)


def point(rank: int, n: int) -> None:
    """Rank `rank` reached its point `n`: die, hang or sleep if a fault says so."""
    if ENV not in os.environ:  # the usual case, checked once (a point is on every step)
        return
    for f in _mine(rank, "die"):
        if f.at == n:
            os._exit(EXIT_CODE)
    for f in _mine(rank, "hang"):
        if f.at == n:
            log.warning("test fault: rank %d hangs at point %d", rank, n)  # tests wait for it
            time.sleep(3600)
    for f in _mine(rank, "slow"):
        time.sleep(f.at)


def write_fails(rank: int, count: int) -> None:
    """Raise ENOSPC if rank `rank`'s checkpoint write number `count` is to fail."""
    for f in _mine(rank, "enospc"):
        if f.at == count:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def forged(rank: int, n: int) -> bool:
    """Whether rank `rank`'s group probe number `n` is to carry a wrong token."""
    return ENV in os.environ and any(f.at == n for f in _mine(rank, "forge"))


def muted(rank: int, n: int) -> bool:
    """Whether rank `rank` is not to answer its group probe number `n`."""
    return ENV in os.environ and any(f.at == n for f in _mine(rank, "mute"))
