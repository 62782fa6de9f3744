"""The all-reduce DistributedDataParallel runs, timed as DDP runs it: in a process of its own
on each machine, whose only process group is the ring's, gloo's I/O threads as gloo starts
them, and nothing else of the calibration's awake on the machines.

The last matters on machines held to a share of a core that share a host's CPUs (a testbed):
each gloo group keeps an I/O thread that wakes 100 times a second, and threads waking anywhere
on the host, whatever their policy or cgroup, made the same ring faster than DDP's ring in a
step. So the calibration times the
rings last (`rings`), once every rank has left its groups.

`rings(...)` on every rank: for K = 2 to all machines, ranks 0..K-1 each start `python -m
netpart.calibrate.ring` beside themselves (`timed`), in their machine's namespace and cgroup;
the processes meet through the job's own store (its file, or torchrun's store at MASTER_ADDR
/ MASTER_PORT, as a client, under a key of their own) and run `netpart.ps.timed_exchange.ps_loop`
over their default group; rank 0 prints the slowest rank's seconds and CPU seconds per size as
one JSON line. Every rank waits at the store until all have finished ring K before ring K + 1
starts: a process waiting for its peers would be awake beside the ring."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from netpart.errors import CalibrationError
from netpart.processes.launcher import STORE_ENV, torchrun_attempt
from netpart.processes.zygote import die_with_parent
from netpart.ps.timed_exchange import ALLREDUCE, ps_loop

__all__ = ["rings", "timed"]

START_S = 120.0  # a process's start (torch's import on a share of a core) and rendezvous

Tables = dict[int, tuple[list[float], list[float]]]


def rings(rank: int, machines: int, sizes: list[int], repeats: list[int], timeout: float) -> Tables:
    """On rank `rank` of `machines`, none of them in a process group: the all-reduce among K
    machines for every K from 2 to `machines`, one ring after another, each of `sizes`
    timed `repeats` (one per size) times. Rank 0: {K: (seconds, CPU seconds) per size, the
    slowest rank's}; the others {}. CalibrationError (one line) if a ring fails or a rank
    does not finish one within its time."""
    wait = datetime.timedelta(seconds=timeout + START_S)
    store = _store("rings", machines, wait)
    out: Tables = {}
    for k in range(2, machines + 1):
        if rank < k:
            got = timed(rank, k, f"ring{k}", sizes, repeats, timeout)
            if rank == 0:
                out[k] = got
        if store.add(f"after{k}", 1) == machines:
            store.set(f"all{k}", "1")
        try:
            store.wait([f"all{k}"], wait)
        except RuntimeError:  # the store's timeout
            raise CalibrationError(
                f"calibration rank {rank}: not every machine finished the all-reduce among {k} "
                f"within {wait.total_seconds():.0f} s"
            ) from None
    return out


def timed(
    rank: int, world: int, key: str, sizes: list[int], repeats: list[int], timeout: float
) -> tuple[list[float], list[float]]:
    """On rank `rank` of the `world` ranks a ring spans (each on its machine): the ring's
    (seconds, CPU seconds) per all-reduce of each of `sizes` (`repeats`: how many of each),
    timed in processes of their own that meet under `key` (the same on every rank, new for
    each ring); rank 0's are the slowest rank's, the others' zeros. CalibrationError (one
    line) if the process fails or outlives `timeout` seconds plus its start; it dies with
    this process."""
    argv = [
        sys.executable,
        "-m",
        "netpart.calibrate.ring",
        str(rank),
        str(world),
        key,
        json.dumps([int(n) for n in repeats]),
        json.dumps([int(b) for b in sizes]),
        str(timeout),
    ]
    limit = timeout + START_S
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=limit, preexec_fn=die_with_parent
        )
    except subprocess.TimeoutExpired:
        raise CalibrationError(
            f"calibration rank {rank}: the all-reduce's own process took longer than {limit:.0f} s"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationError(
            f"calibration rank {rank}: the all-reduce's own process "
            f"failed (exit {done.returncode}): {last}"
        )
    if rank != 0:
        return [0.0] * len(sizes), [0.0] * len(sizes)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return [float(t) for t in got[: len(sizes)]], [float(c) for c in got[len(sizes) :]]


def _store(key: str, world: int, timeout: datetime.timedelta) -> dist.Store:
    """Where ranks meet under `key`: beside the job's file store, or in torchrun's."""
    path = os.environ.get(STORE_ENV)
    if path:
        return dist.FileStore(f"{path}.{key}", world)
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"netpart/attempt{torchrun_attempt()}/{key}/", client)


def main(argv: list[str]) -> int:
    rank, world, key = int(argv[0]), int(argv[1]), argv[2]
    repeats, sizes, timeout = json.loads(argv[3]), json.loads(argv[4]), float(argv[5])
    wait = datetime.timedelta(seconds=timeout)
    torch.set_num_threads(1)  # as every worker process
    dist.init_process_group(
        "gloo", store=_store(key, world, wait), rank=rank, world_size=world, timeout=wait
    )
    try:
        seconds, cpu = [], []
        for size, n in zip(sizes, repeats, strict=True):
            (t,), (c,) = ps_loop(dist.group.WORLD, rank, ALLREDUCE, [size], n)
            seconds.append(t)
            cpu.append(c)
        slowest = torch.tensor([*seconds, *cpu], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        sys.stdout.write(json.dumps(slowest.tolist()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
