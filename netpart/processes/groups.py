"""Process groups checked before use, and formed again on fresh listeners when a check fails.

gloo pairs two processes by a sequence number that the connecting side writes first: its
listener hands an accepted connection to whichever pair waits for that number, and it has no
way to tell the job's peer from anyone else who connects. While a group forms, a connection
that is not the job's (any local user can reach a loopback listener) can take a peer's place;
the pair then reads the stranger's bytes, and the group's first exchange never completes.

So every group a job forms is probed before use: its members all-gather a random token each
drew and published in the job's store (the private file store of a local job, the rendezvous
store under torchrun), under a short deadline (`PROBE_S`, the operation's own timeout too, so
a stuck probe ends by itself and leaves nothing waiting). Every member then posts its verdict
— in the store for the job's default group, over the already checked default group for the
groups made after it — and if any member saw a wrong token or no answer, all of them drop the
group and form it again on new listeners, up to `ATTEMPTS` times. A foreign connection costs
the job one probe's time per group it spoiled; it is not let in.
"""

from __future__ import annotations

import datetime
import logging
import secrets

import torch
import torch.distributed as dist

from netpart import faults
from netpart.errors import RuntimeFailure

__all__ = ["ATTEMPTS", "PROBE_S", "form_default_group", "new_groups", "wait_bounded"]

log = logging.getLogger(__name__)

PROBE_S = 2.0  # s: a healthy probe takes milliseconds once every member has formed the group
ATTEMPTS = 3  # groups formed at most this often: start-up stays inside its 10 s deadline
TOKEN_BITS = 62

_state = {"probes": 0, "tokens": None}  # this process's probes so far; the default group's tokens


def form_default_group(
    store: dist.Store, rank: int, world: int, timeout: datetime.timedelta
) -> int:
    """`init_process_group` (gloo) over `store`, checked, re-formed under a fresh key prefix
    until a check passes; returns the attempt that passed. RuntimeFailure after `ATTEMPTS`."""
    for attempt in range(ATTEMPTS):
        prefixed = dist.PrefixStore(f"netpart/form{attempt}/", store)
        dist.init_process_group(
            "gloo", store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
        token = secrets.randbits(TOKEN_BITS)
        prefixed.set(f"token{rank}", str(token))
        keys = [f"token{r}" for r in range(world)]
        _wait_keys(prefixed, keys, "the job's group tokens")
        tokens = [int(prefixed.get(k)) for k in keys]
        ok = _probe(dist.group.WORLD, token, tokens, timeout)
        prefixed.set(f"ok{rank}", "1" if ok else "0")
        verdicts = [f"ok{r}" for r in range(world)]
        _wait_keys(prefixed, verdicts, "the job's group check")
        if all(prefixed.get(k) == b"1" for k in verdicts):
            _state["tokens"] = tokens
            return attempt
        log.warning("the job's group failed its check (attempt %d): forming it again", attempt)
        dist.destroy_process_group()
    raise _refused("the job's process group")


def new_groups(
    members: list[list[int]], timeout: datetime.timedelta
) -> list[dist.ProcessGroup | None]:
    """`dist.new_group` for each list of ranks (every rank calls this with the same lists),
    checked like the default group; the verdicts travel over the default group. A rank gets
    None for a group it is not in."""
    rank, tokens = dist.get_rank(), _state["tokens"]
    if tokens is None:
        raise RuntimeError("new_groups before form_default_group")
    for attempt in range(ATTEMPTS):
        groups = [dist.new_group(m, timeout=timeout) for m in members]
        ok = all(
            _probe(g, tokens[rank], [tokens[r] for r in m], timeout)
            for g, m in zip(groups, members, strict=True)
            if rank in m
        )
        verdict = torch.tensor(1 if ok else 0, dtype=torch.int64)
        work = dist.all_reduce(verdict, op=dist.ReduceOp.MIN, async_op=True)
        stopped = "a process of the job stopped while it started"
        wait_bounded(work, 4 * PROBE_S, "the checks of the job's groups", stopped)
        if verdict.item() == 1:
            return [g if rank in m else None for g, m in zip(groups, members, strict=True)]
        log.warning("a group failed its check (attempt %d): forming them again", attempt)
        for g, m in zip(groups, members, strict=True):
            if rank in m:
                dist.destroy_process_group(g)
    raise _refused("the job's process groups")


def _probe(
    group: dist.ProcessGroup, token: int, expected: list[int], timeout: datetime.timedelta
) -> bool:
    """Whether `group`'s members hand each other the tokens they published, in time. The
    probe's operation carries the short deadline (so a stuck probe ends by itself); the
    group gets `timeout` back after it."""
    n = _state["probes"]
    _state["probes"] += 1
    if faults.forged(dist.get_rank(), n):
        token = token ^ 1  # as bytes from a connection that is not the job's would read
    if faults.muted(dist.get_rank(), n):
        return False  # as a member whose pair a stranger took: it never answers
    group.set_timeout(datetime.timedelta(seconds=PROBE_S))
    got = [torch.zeros((), dtype=torch.int64) for _ in expected]
    try:
        work = dist.all_gather(
            got, torch.tensor(token, dtype=torch.int64), group=group, async_op=True
        )
        work.wait(timeout=datetime.timedelta(seconds=PROBE_S + 1))
        ok = [int(t) for t in got] == expected
    except RuntimeError as exc:
        log.warning("a group's probe failed: %s", str(exc).splitlines()[0][:200])
        ok = False
    group.set_timeout(timeout)
    return ok


def _wait_keys(store: dist.Store, keys: list[str], what: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=4 * PROBE_S))
    except RuntimeError as exc:  # torch's DistStoreError is one
        raise RuntimeFailure(
            f"{what} did not arrive within {4 * PROBE_S:g} s ({exc}): a process of the "
            "job stopped while it started"
        ) from None


def wait_bounded(work, seconds: float, what: str, why: str) -> None:
    """Wait for a torch.distributed `work` at most `seconds`; else RuntimeFailure (one line)
    naming `what` and the likely cause, `why`."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:
        raise RuntimeFailure(
            f"{what} did not complete within {seconds:g} s ({exc}): {why}"
        ) from None


def _refused(what: str) -> RuntimeFailure:
    return RuntimeFailure(
        f"{what} failed its check {ATTEMPTS} times: connections that are not the job's keep "
        "reaching its listeners while it starts (another user on this machine or network?)"
    )
