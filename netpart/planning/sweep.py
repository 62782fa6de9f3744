"""How many workers to book: predicted step and speedup per worker count, and the knee.

`knee` is pure: given the predicted step at each worker count, the recommended count is the
last one whose doubling of the workers (from the count before it) still made the step at
least `gain` times faster, or the first count if none did (counts that are not powers of two
are compared per doubling: (step_a / step_b) ** (1 / log2(b / a))). A first split that pays
more in exchange than it saves does not hide later doublings that pay. `peak` is the count
with the fastest step; past the knee, more workers cost machines for little time, and past
the peak they cost time too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from netpart.cost.machine import Machine
from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.blocks import Granularity
from netpart.partition.graph import graph_size
from netpart.partition.planner import plan

__all__ = ["DEFAULT_GAIN", "SweepResult", "knee", "parse_counts", "spreadable", "sweep"]

DEFAULT_GAIN = 1.25  # a doubling of the workers must make the step this much faster


@dataclass(frozen=True)
class SweepResult:
    """Predicted seconds per step at each worker count, and what to book."""

    model: str
    counts: tuple[int, ...]
    step_s: tuple[float, ...]
    gain: float
    knee: int
    peak: int
    prediction: str  # which network model or profile

    @property
    def speedups(self) -> tuple[float, ...]:
        """Against the first count (1 worker when the sweep starts there)."""
        return tuple(self.step_s[0] / s for s in self.step_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": list(self.speedups)}


def knee(counts: list[int], steps: list[float], gain: float = DEFAULT_GAIN) -> tuple[int, int]:
    """(knee, peak) of predicted `steps` at increasing `counts` (see the module docstring)."""
    if not counts or len(counts) != len(steps):
        raise ValueError("one predicted step per worker count")
    paid = [
        b
        for a, b, ta, tb in zip(counts, counts[1:], steps, steps[1:], strict=False)
        if (ta / tb) ** (1.0 / math.log2(b / a)) >= gain
    ]
    peak = counts[min(range(len(steps)), key=steps.__getitem__)]
    return (paid[-1] if paid else counts[0]), peak


def parse_counts(text: str) -> list[int]:
    """'1,2,4,8' or '1-128' (powers of two from the first to the last): sorted, unique, >= 1;
    ValueError with what is wrong."""
    text = text.strip()
    if "-" in text and "," not in text:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi)
        if not 1 <= a <= b:
            raise ValueError(f"{text!r}: a range is LOW-HIGH with 1 <= LOW <= HIGH")
        out, n = [], a
        while n < b:
            out.append(n)
            n *= 2
        return [*out, b]
    counts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not counts or counts[0] < 1:
        raise ValueError(f"{text!r}: worker counts must be integers >= 1")
    return counts


def spreadable(
    spec: ModelSpec, counts: list[int], blocks_per_worker: int
) -> tuple[list[int], str | None]:
    """The counts the model can spread over (each worker owning part of its widest layer),
    and a note naming the first count dropped and why (None if none was); PlanError if none
    is left."""

    def widest(n: int):
        return graph_size(spec, Granularity.for_workers(n, blocks_per_worker))

    kept = [n for n in counts if n <= widest(n).widest]
    if not kept:
        raise PlanError(f"--sweep: {spec.name} cannot spread over {counts[0]} workers or more")
    if len(kept) == len(counts):
        return kept, None
    size = widest(counts[len(kept)])
    note = (
        f"counts above {kept[-1]} skipped: {spec.name}'s widest layer, "
        f"{size.widest_layer}, has at most {size.widest} blocks"
    )
    return kept, note


def sweep(
    spec: ModelSpec,
    counts: list[int],
    network: Machine,
    *,
    method: str,
    seed: int,
    batch: int,
    blocks_per_worker: int,
    gain: float,
    memory: int,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda counts: counts,
) -> SweepResult:
    """One plan per worker count of `counts` (`progress` wraps their iteration), its
    predicted step, and the knee."""
    if not gain > 1:
        raise PlanError(f"--gain {gain}: must be > 1 (a doubling that buys nothing)")
    steps = []
    for n in progress(counts):
        granularity = Granularity.for_workers(n, blocks_per_worker)
        p = plan(
            spec,
            n,
            method,
            seed=seed,
            batch=batch,
            network=network,
            granularity=granularity,
            memory=memory,
        )
        steps.append(p.metrics.predicted_step_s)
    k, peak = knee(counts, steps, gain)
    return SweepResult(spec.name, tuple(counts), tuple(steps), gain, k, peak, network.describe())
