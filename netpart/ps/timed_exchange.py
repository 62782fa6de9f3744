"""The parameter server's own exchange, measured with its own code: `clients` workers push
their gradients to one shard and fetch its values, a round per step, as a training job of
the given mode does (sync: every request completed before the next; Downpour: the courier
keeps two in flight, as `netpart.train.replica` does), nothing else running beside it. What
`netpart calibrate` records as the profile's parameter-server tables, and what `netpart plan
--machines` prices a parameter-server layout's exchange from (`netpart.cost.exchange`):
the time of an exchange at each size where the shard or the wire limits it, and the CPU a
client spends on one (the part a step's compute cannot hide where the machine's core is the
limit).

The group's last ranks are the shards (calibration: one); ranks 0..clients-1 are the clients
(replica = rank).

Beside it, what the parameter server's alternative does (mode `ALLREDUCE`, no shards): every
rank of the group all-reduces the bytes, gloo's ring, as DistributedDataParallel's replicas
all-reduce their gradients a step (what `netpart plan --machines` prices an all-reduce layout
from).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from netpart.compile.shards import ParamPiece, ShardLayout
from netpart.ps.client import ShardClient
from netpart.ps.modes import Downpour, Sync
from netpart.ps.optimizer import Optimizer
from netpart.ps.rules import make_rule
from netpart.ps.server import ShardServer, ShardSetup, ShardState
from netpart.timing import mean_call

__all__ = ["ALLREDUCE", "flat_layout", "ps_loop", "stand_in", "timed_calls", "warm_exchanges"]

WARM = 3  # untimed exchanges before each size's timed ones
# From WARM_BYTES up, fewer: one sync exchange, two Downpour ones (it keeps two in flight, and
# its first timed exchange must find them so). There an exchange is the wire's, already
# steady after those, and the warm-up was most of a large size's exchanges at calibration's
# repeats (2-3 timed).
WARM_BYTES = 4_000_000
ALLREDUCE = "allreduce"  # the mode of every rank all-reducing (no shards)


def timed_calls(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(seconds, CPU seconds of the process, all threads) per call of `fn`, means over
    `repeats` back-to-back calls after WARM untimed: what `ps_loop`'s `beside` costs alone."""
    timed = mean_call(fn, repeats, warm=WARM)
    return timed.seconds, timed.cpu


def stand_in(cpu_s: float, values: int) -> Callable[[], None]:
    """A training step's stand-in, for `ps_loop`'s `beside`: it writes `values` float32 (a
    step's gradients, which the push then sends) and multiplies matrices on the calling
    thread until that thread has spent `cpu_s` CPU seconds (a step's compute, on one
    thread as netpart's workers run it). What calibration runs before each request to time
    an exchange as it follows a step of a given CPU, whatever the model."""
    a = torch.rand(128, 128)

    def step() -> None:
        end = time.thread_time() + cpu_s
        torch.ones(max(int(values), 1))  # allocated afresh and freed, as autograd's
        while time.thread_time() < end:
            torch.mm(a, a)

    return step


def flat_layout(values: int, shards: int = 1) -> ShardLayout:
    """One worker whose `values` parameters (a dense layer's weight) `shards` shards hold,
    in even ranges."""
    rows = np.arange(values, dtype=np.int64)
    piece = ParamPiece(0, "weight", "dense", 0, 1, rows, values)
    bounds = np.linspace(0, values, shards + 1).round().astype(np.int64)
    return ShardLayout(
        1,
        shards,
        ((piece,),),
        (np.zeros(1, dtype=np.int64),),
        np.array([values], dtype=np.int64),
        bounds,
    )


def ps_loop(
    group: dist.ProcessGroup,
    rank: int,
    mode: str,
    sizes: list[int],
    repeats: int,
    shards: int = 1,
    beside: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """On every rank of `group` (its last `shards` ranks the shards, the others clients):
    per size (bytes a client pushes and fetches, over all shards), a client's mean seconds
    per exchange and its process's CPU seconds per exchange, all threads (a shard: zeros).
    `beside`: run by a client before each request, as a training step runs before its push
    (sync: then the exchange; Downpour: beside the one in flight); the calibration runs
    none. Mode `ALLREDUCE` (`shards` 0): every rank all-reduces each size, its seconds and
    CPU seconds per all-reduce (`beside`: run by every rank before each, as DDP's replicas
    compute a step before its all-reduce completes)."""
    if mode == ALLREDUCE:
        return _allreduce(group, sizes, repeats, beside)
    clients = group.size() - shards
    seconds, cpu = [], []
    for size in sizes:
        layout = flat_layout(max(int(size) // 4, shards), shards)
        if rank >= clients:
            s = rank - clients
            values = torch.zeros(int(layout.shard_sizes()[s]))
            setup = ShardSetup(layout, s, clients, rank, lambda r, w: r)
            policy = Sync() if mode == "sync" else Downpour()
            rule = make_rule(Optimizer(), values)
            ShardServer(setup, ShardState(values=values, state=None), policy, rule, group).serve()
            seconds.append(0.0)
            cpu.append(0.0)
        else:
            wall, used = _client(layout, group, rank, mode, repeats, beside)
            seconds.append(wall)
            cpu.append(used)
        dist.barrier(group=group)
    return seconds, cpu


def _client(layout, group, rank: int, mode: str, repeats: int, beside=None) -> tuple[float, float]:
    """(seconds, CPU seconds) per exchange of one client, means over `repeats` (at least 2)
    after WARM untimed. A training step's throughput is its mean, and on a fraction of a core
    the periods a machine is throttled lengthen some exchanges, so a step's mean can sit well
    above its median. The seconds are
    from request to request: Downpour's last requests, still in flight, are not its pace."""
    clients = group.size() - layout.shards
    downpour = mode == "downpour"
    client = ShardClient(
        layout,
        worker=0,
        replica=rank,
        rank=rank,
        shard_ranks=list(range(clients, group.size())),
        dtype=torch.float32,
        background=downpour,
        group=group,
    )
    grads = client.push_buffers(2)
    for g in grads:
        g.normal_()
    client.complete(client.request(0, fetch=True))
    inflight: collections.deque = collections.deque()
    stamps, cpu_at = [], 0.0
    warm = warm_exchanges(mode, layout.total * 4)
    for step in range(1, warm + repeats + 1):
        if step == warm + 1:
            cpu_at = time.process_time()
        stamps.append(time.perf_counter())
        if beside is not None:
            beside()
        ticket = client.request(step, grads[step % 2], fetch=True)
        if not downpour:
            client.complete(ticket)
            continue
        inflight.append(ticket)
        while len(inflight) > 1:  # two in flight, as a Downpour worker keeps them
            client.complete(inflight.popleft())
    while inflight:
        client.complete(inflight.popleft())
    stamps.append(time.perf_counter())
    used = (time.process_time() - cpu_at) / repeats
    client.close()
    return (stamps[-2] - stamps[warm]) / (repeats - 1), used


def warm_exchanges(mode: str, size: int) -> int:
    """Untimed exchanges of `size` bytes before the timed ones (`WARM_BYTES`)."""
    if size < WARM_BYTES:
        return WARM
    return 2 if mode == "downpour" else 1


def _allreduce(
    group, sizes: list[int], repeats: int, beside: Callable[[], None] | None
) -> tuple[list[float], list[float]]:
    """(seconds, CPU seconds) per all-reduce of each size's float32 values over `group`, the
    means of `repeats` (at least 2) back to back after WARM untimed, as a training step's
    all-reduce follows the last one; `beside` before each, its time included."""
    seconds, cpu = [], []

    def once(grads: torch.Tensor) -> None:
        if beside is not None:
            beside()
        dist.all_reduce(grads, group=group)

    for size in sizes:
        grads = torch.zeros(max(int(size) // 4, 1))  # sums stay 0: no overflow, no subnormals
        timed = mean_call(lambda g=grads: once(g), repeats, warm=WARM)
        seconds.append(timed.seconds)
        cpu.append(timed.cpu)
        dist.barrier(group=group)
    return seconds, cpu
