"""The step a DistributedDataParallel replica runs, timed on a calibrated machine: a model's
reference module (`netpart.models.build_reference`, the plain torch module a user would wrap
in DDP), its forward, backward and fused Adagrad's update of the whole model, on one thread,
float32, without the all-reduce (the profile's `allreduce` tables time the ring).

The planner prices an all-reduce layout's replica with it (`netpart.planning.cluster`).
netpart's own one-worker step does not stand in for it: a plain module's step and a whole
model's update cost a different CPU than netpart's step, and a machine held to a share of a
core turns that CPU into time at its own rate (docs/planning.md has both steps on testbed
machines). Timed in this process, on the machine calibration measures slices on, as a
replica runs it alone; the profile keeps each calibrated model's median step
(`PsExchange.replica`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from netpart.models import build_reference
from netpart.models.spec import ModelSpec
from netpart.runtime.check import make_batch
from netpart.runtime.step import timed_steps
from netpart.timing import each_call, time_call

__all__ = ["REPLICA_RUNS", "replica_step", "replica_steps"]

log = logging.getLogger(__name__)

REPLICA_RUNS = 3  # runs of each model's replica step at most (median): a wide model's is long
LEARNING_RATE = 0.01  # the rate does not change a step's time; Adagrad's own default


def replica_step(spec: ModelSpec, batch: int, steps: int, seconds: float) -> tuple[float, float]:
    """(seconds, CPU seconds of the process) of `spec`'s reference step with its update: the
    median over at least `steps` timed steps and about `seconds` of them, after untimed
    ones (`netpart.runtime.step.timed_steps`, from the first step's time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a replica's process, and every netpart worker
    try:
        model = build_reference(spec)
        opt = torch.optim.Adagrad(model.parameters(), lr=LEARNING_RATE, fused=True)
        x, y = make_batch(spec, batch, 0)
        x = x.float()

        def step() -> None:
            opt.zero_grad()
            model.loss(model(x), y).backward()
            opt.step()

        count, warm = timed_steps(time_call(step)[0].seconds, steps, seconds)
        runs = each_call(step, count, warm=warm)
        wall, cpu = [r.seconds for r in runs], [r.cpu for r in runs]
        return float(np.median(wall)), float(np.median(cpu))
    finally:
        torch.set_num_threads(threads)


def replica_steps(
    specs: list[ModelSpec],
    *,
    batch: int,
    steps: int,
    seconds: float,
    runs: int,
    say: Callable[[str], None] = log.info,
) -> dict:
    """`ps.replica` (`netpart.cost.exchange`): per model of `specs`, the median over `runs`
    (at most REPLICA_RUNS) of `replica_step`'s seconds and CPU seconds, at `batch`."""
    runs = max(1, min(runs, REPLICA_RUNS))
    out: dict = {"batch": batch, "seconds": {}, "cpu_s": {}}
    for spec in specs:
        timed = [replica_step(spec, batch, steps, seconds) for _ in range(runs)]
        wall, cpu = (float(np.median(t)) for t in zip(*timed, strict=True))
        out["seconds"][spec.name], out["cpu_s"][spec.name] = wall, cpu
        say(
            f"a DDP replica's step of {spec.name} (its reference module and update, no ring): "
            f"{wall * 1e3:.2f} ms, {cpu * 1e3:.2f} ms CPU"
        )
    return out
