"""The one timing helper: how netpart times a call, a run of calls, or cases side by side.

Calibration (slices, the link, a DDP replica's step, the parameter server's exchange, the
ring), `netpart run` and every benchmark time through these, so that a warm-up, a mean, a
median and a call's CPU mean the same everywhere:

- `Timed`: one call's wall seconds and the CPU seconds of the process (every thread) or of
  the calling thread (`thread=True`, where other threads of the process must not count);
- `time_call`: one call, timed;
- `mean_call`: `repeats` back-to-back calls after `warm` untimed ones, the means (the pace of
  a loop: what a throughput is made of);
- `each_call`: `count` calls after `warm` untimed ones, every call's figures (for medians);
- `alternate`: cases timed side by side in rounds, the order reversed every other round, so
  that a host's slow spell falls on every case alike; `probe` (a callable timed beside each
  run, e.g. netpart's speed probe) says how fast the host ran meanwhile.

The bottom floor: it imports no room of netpart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

__all__ = ["Rounds", "Timed", "alternate", "each_call", "mean_call", "time_call"]


@dataclass(frozen=True)
class Timed:
    """Wall seconds and CPU seconds of one call (or a mean of calls)."""

    seconds: float
    cpu: float


def _cpu(thread: bool) -> float:
    return time.thread_time() if thread else time.process_time()


def time_call(fn: Callable[[], object], *, thread: bool = False) -> tuple[Timed, object]:
    """(its time, its result) of one call of `fn`."""
    t0, c0 = time.perf_counter(), _cpu(thread)
    out = fn()
    return Timed(time.perf_counter() - t0, _cpu(thread) - c0), out


def mean_call(
    fn: Callable[[], object], repeats: int, *, warm: int = 0, thread: bool = False
) -> Timed:
    """The mean time of `repeats` back-to-back calls of `fn`, after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    t0, c0 = time.perf_counter(), _cpu(thread)
    for _ in range(repeats):
        fn()
    return Timed((time.perf_counter() - t0) / repeats, (_cpu(thread) - c0) / repeats)


def each_call(
    fn: Callable[[], object],
    count: int,
    *,
    warm: int = 0,
    thread: bool = False,
    before: Callable[[], object] | None = None,
) -> list[Timed]:
    """Every one of `count` calls of `fn`, timed, after `warm` untimed ones; `before` runs
    untimed before each call, the warm ones too (a barrier that starts peers together)."""
    out = []
    for i in range(warm + count):
        if before is not None:
            before()
        timed, _ = time_call(fn, thread=thread)
        if i >= warm:
            out.append(timed)
    return out


@dataclass
class Rounds:
    """What `alternate` measured, per case in the order given (the first is the base): each
    run's seconds (the call's own figure where it returned a float: a step time it read off
    its run), its CPU, and the probe beside it."""

    names: list[str]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    probe: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def median_cpu(self, name: str) -> float:
        return statistics.median(self.cpu[name])

    def ratio(self, name: str) -> float:
        """A case's median over the first case's."""
        return self.median(name) / self.median(self.names[0])

    def round_ratios(self, a: str, b: str) -> list[float]:
        """Case `a`'s seconds over case `b`'s, round by round (their median is the figure
        least moved by the host's slow spells, which a round's two runs share)."""
        return [x / y for x, y in zip(self.seconds[a], self.seconds[b], strict=True)]

    def to_dict(self) -> dict:
        return {
            "base": self.names[0],
            "cases": {
                n: {
                    "median_s": self.median(n),
                    "median_cpu_s": self.median_cpu(n),
                    "ratio": self.ratio(n),
                    "runs_s": self.seconds[n],
                    "cpu_s": self.cpu[n],
                    "probe_s": self.probe[n],
                }
                for n in self.names
            },
        }


def alternate(
    cases: dict[str, Callable[[], object]],
    *,
    rounds: int,
    warm: int = 1,
    probe: Callable[[], AbstractContextManager] | None = None,
) -> Rounds:
    """Time each of `cases` (name -> a call) `rounds` times, side by side: round r runs them
    in the given order when r is even, reversed when odd, after `warm` untimed calls each. A
    call that returns a float measured itself (a step time read off its run): that float is
    its seconds. `probe()`: a context manager sampled beside each run whose `median()` is
    recorded (netpart's `SpeedProbe`); none records 0."""
    for run in cases.values():
        for _ in range(warm):
            run()
    out = Rounds(list(cases))
    for name in cases:
        out.seconds[name], out.cpu[name], out.probe[name] = [], [], []
    for r in range(rounds):
        for name in out.names if r % 2 == 0 else out.names[::-1]:
            if probe is None:
                timed, value = time_call(cases[name])
                speed = 0.0
            else:
                with probe() as sampler:
                    timed, value = time_call(cases[name])
                speed = sampler.median()
            out.seconds[name].append(value if isinstance(value, float) else timed.seconds)
            out.cpu[name].append(timed.cpu)
            out.probe[name].append(speed)
    return out
