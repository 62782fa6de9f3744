"""Will a job fit this machine? A job's memory on one machine, from the one estimate of what a
worker and a shard hold (`netpart.cost.memory`): `netpart train` refuses a job with it before
anything starts, and `plan --machines` weighs layouts with the same formulas.

A job that cannot fit must be refused in one line with its figures, not started: thousands of
processes, or a few that each try to allocate tens of GiB, take the machine down before any
error can be reported. Every process pays the interpreter with torch loaded; a worker holds
its parameters about four times (values, gradients, the fetched copy, the optimizer's
buffers) and, per example of its batch, what `activation_values` counts; a shard holds its
values and its optimizer state. The weights of `activation_values` are fitted to measured
peaks (`benchmarks/memory_bench.py`; how close, in docs/measurements.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from netpart.cost.memory import BASE_BYTES, activation_values, shard_bytes, worker_bytes
from netpart.errors import TrainError
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan

__all__ = ["Estimate", "check_crowding", "check_fits", "check_process_count", "estimate"]

_GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    """Bytes the job's processes need on one machine, by role."""

    processes: int
    workers_bytes: int
    shards_bytes: int

    @property
    def total(self) -> int:
        return self.processes * BASE_BYTES + self.workers_bytes + self.shards_bytes


def estimate(
    spec: ModelSpec,
    plan: PartitionPlan,
    *,
    batch: int,
    replicas: int,
    processes: int,
    dtype: str = "float32",
    optimizer: str = "adagrad",
    history: int = 10,
) -> Estimate:
    """The job's memory on one machine (every process local)."""
    value = 8 if dtype == "float64" else 4
    halo = sum(w.halo_in_bytes for w in plan.per_worker) // 4  # received values per example
    params = sum(w.params for w in plan.per_worker)
    acts = activation_values(spec) + 2 * halo
    per_replica = worker_bytes(params=params, activations=acts, batch=batch, value_bytes=value)
    shards = shard_bytes(values=params, optimizer=optimizer, value_bytes=value, history=history)
    return Estimate(processes, int(replicas * per_replica), int(shards))


def check_process_count(processes: int, what: str, *, available: int) -> None:
    """Refuse, before planning, a job whose processes alone cannot fit in `available` bytes."""
    free = available
    if processes * BASE_BYTES > free:
        raise TrainError(
            f"{what}: {processes:,} processes need at least {processes * BASE_BYTES / _GIB:.1f} "
            f"GiB (about {BASE_BYTES // 2**20} MB each with torch loaded), this machine has "
            f"{free / _GIB:.1f} GiB available; use fewer workers or replicas, or spread the "
            "job over machines with torchrun"
        )
    limit = os.sysconf("SC_CHILD_MAX") if hasattr(os, "sysconf") else -1
    if limit and limit > 0 and processes > limit:
        raise TrainError(f"{what}: {processes:,} processes exceed this user's limit of {limit:,}")


def check_fits(spec: ModelSpec, plan: PartitionPlan, *, available: int, **job) -> Estimate:
    """Refuse (TrainError, one line with the figures) a job that would not fit in `available`
    bytes (`job`: `estimate`'s keywords)."""
    est = estimate(spec, plan, **job)
    free = available
    if est.total > free:
        raise TrainError(
            f"the job needs about {est.total / _GIB:.1f} GiB on this machine ({est.processes} "
            f"processes: workers {est.workers_bytes / _GIB:.1f} GiB, shards "
            f"{est.shards_bytes / _GIB:.1f} GiB, interpreters "
            f"{est.processes * BASE_BYTES / _GIB:.1f} GiB) and {free / _GIB:.1f} GiB is "
            "available; use fewer replicas, more workers per replica, float32, or more machines "
            "(torchrun)"
        )
    return est


CROWDED = 8  # processes a core beyond which a job on one machine is refused unless forced


def check_crowding(processes: int, what: str, *, cores: int, force: bool) -> None:
    """TrainError (one line) for a job of more than CROWDED processes a core on this machine,
    unless `force` (short of that, train's banner says the processes share the cores)."""
    if processes <= CROWDED * cores or force:
        return
    raise TrainError(
        f"{what}: {processes:,} processes on this machine's {cores} cores, about "
        f"{cores / processes:.2g} of a core each, and more than {CROWDED} a core is refused; "
        "use fewer workers or replicas, spread the job over machines with torchrun, or --force"
    )
