"""Compute traces: the time of every worker's slice of every layer, measured by executing it.

For calibration (`netpart.calibrate.measure`: the slice tables) and the emulated machines'
validation: a plan for N workers cannot be run as N busy processes on a small machine, but
each worker's slice of each layer can be built
and run alone, one at a time, on one thread, exactly as the worker would run it (same slice
classes, full-size input buffer, backward through the input for every layer but the first; a
whole conv, pool or LCN layer on its input planes, `LayerSlice.plane`).
Weights are a constant (building reference initialisations of a 1.7B-parameter model would
take longer than timing it); the arithmetic is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from netpart.compile.schedule import plan_schedule
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan
from netpart.processes.memory import keep_freed_memory
from netpart.runtime.build import build_slice
from netpart.timing import time_call

__all__ = ["SliceTimes", "measure_slices"]

log = logging.getLogger(__name__)

REPEAT_BELOW_S = 0.2  # slices faster than this are timed at least three times after the warm-up
TIMED_LEAST_S = 0.02  # and for at least this long in all (at most MOST_RUNS runs): the best of
MOST_RUNS = 9  # a few runs spread over time, so a slow moment of the machine is not the time


@dataclass(frozen=True, eq=False)
class SliceTimes:
    """forward[l, w] and backward[l, w]: seconds of worker w's slice of layer l at `batch`."""

    forward: np.ndarray
    backward: np.ndarray
    batch: int

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"forward": self.forward, "backward": self.backward, "batch": np.array(self.batch)}

    @classmethod
    def from_arrays(cls, a) -> SliceTimes:
        return cls(np.asarray(a["forward"]), np.asarray(a["backward"]), int(a["batch"]))


def measure_slices(
    spec: ModelSpec,
    plan: PartitionPlan,
    batch: int,
    dtype: torch.dtype = torch.float32,
    on_slice: Callable[[int, int], None] | None = None,
    share: float = 1.0,
) -> SliceTimes:
    """Run every (layer, worker) slice of `plan` alone on one thread and time it.

    `on_slice(done, total)` reports progress. Restores the caller's torch thread count. On a
    machine with `share` of a core (a cpu cgroup's quota), a slice takes at least its CPU
    time / `share` (`_time_slice`).
    """
    if not 0 < share <= 1:
        raise ValueError(f"share is a fraction of one core, not {share}")
    keep_freed_memory()  # as every worker process does: no page faults in the timings
    graph, schedule = plan_schedule(spec, plan, validate=False)
    layers, workers = len(spec.layers), plan.workers
    fwd = np.zeros((layers, workers))
    bwd = np.zeros((layers, workers))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(layers):
            n_in = spec.input_shape(i).size
            x = torch.randn(n_in + 2, batch, dtype=dtype)
            x[n_in] = 0.0
            x[n_in + 1] = float("-inf")  # the padding rows of ModelWorker's buffers
            x.requires_grad_(i > 0)
            for w in range(workers):
                units = schedule.owned[i][w]
                if len(units):
                    layer_slice = build_slice(spec, i, units, graph.layers[i], None, dtype)
                    if layer_slice.plane:  # a whole layer: on planes, as the worker runs it
                        planes = _planes(spec, i, x)
                        timed = _time_slice(layer_slice, planes, share, layer_slice.forward_plane)
                    else:
                        timed = _time_slice(layer_slice, x, share)
                    fwd[i, w], bwd[i, w] = timed
                    del layer_slice
                if on_slice is not None:
                    on_slice(i * workers + w + 1, layers * workers)
    finally:
        torch.set_num_threads(threads)
    return SliceTimes(fwd, bwd, batch)


def _planes(spec: ModelSpec, index: int, x: torch.Tensor) -> torch.Tensor:
    """Layer `index`'s input buffer `x` [n + 2, B] as the planes [B, C, H, W] a worker holding
    the whole layer below passes it (contiguous; a fresh leaf but for the first layer)."""
    src = spec.input_shape(index)
    planes = x.detach()[: src.size].T.reshape(-1, src.channels, src.height, src.width)
    return planes.contiguous().requires_grad_(index > 0)


def _time_slice(
    layer_slice, x: torch.Tensor, share: float = 1.0, forward: Callable | None = None
) -> tuple[float, float]:
    """(forward, backward) seconds: the best of two runs after a warm-up run (which also
    allocates and first-touches the gradients); for slices under REPEAT_BELOW_S, of at least
    three runs that take TIMED_LEAST_S in all (at most MOST_RUNS). Each run counts at least
    its CPU time / `share`: under a cpu quota the best wall time of a short run is one that
    found the period's quota unspent (a run at a whole core's speed), and in a step every
    slice pays its share of the throttling. `forward` runs the slice (its module call by
    default)."""
    forward = layer_slice if forward is None else forward
    runs: list[tuple[float, float]] = []
    while len(runs) <= MOST_RUNS:
        x.grad = None
        ahead, out = time_call(lambda: forward(x), thread=True)
        behind, _ = time_call(
            lambda o=out: o.requires_grad and torch.autograd.backward(o, torch.ones_like(o)),
            thread=True,
        )
        runs.append(tuple(max(t.seconds, t.cpu / share) for t in (ahead, behind)))
        del out
        for p in layer_slice.parameters():
            p.grad = None
        if len(runs) == 3 and sum(runs[0]) >= REPEAT_BELOW_S:
            break
        if len(runs) >= 4 and sum(map(sum, runs[1:])) >= TIMED_LEAST_S:
            break
    best = min(runs[1:], key=sum)
    return float(best[0]), float(best[1])
