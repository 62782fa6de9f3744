"""How fast this machine runs now: a probe sampled while a measurement runs.

A shared machine does not keep one speed: a virtual machine can move between a fast and a
slow state for spells of seconds to minutes while the kernel reports no steal, and small
kernels slow down most (docs/planning.md, "the speed probe", has what was measured).
`SpeedProbe`
samples, in a thread of the calling process, the CPU time of a fixed small forward and
backward (`probe_once`: many small kernels, as a partitioned step's slices are) every `every`
seconds. A run's probe is its median sample; against a profile's `probe_s` (the median of its
calibration runs' probes) it says how much slower or faster the machine ran than while it
was calibrated, which a prediction cannot know.

CPU time, not wall time: a probe descheduled by the workers it shares cores with, or held by
a cpu quota, reads the same. A sample is kept small (PROBE_REPEATS passes of a small MLP), so
the probe takes little of a core from the measurement. It runs on a core the measured
processes leave free: it sees the machine's state, not what the workers' own cores go through.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

__all__ = ["PROBE_REPEATS", "SLOW_SPELL", "SpeedProbe", "probe_once"]

PROBE_BATCH, PROBE_WIDTH = 32, 128  # a 64-128-10 MLP at batch 32
PROBE_REPEATS = 8  # forward and backward passes a sample times
SLOW_SPELL = 1.1  # a probe this many times the calibration's: the machine ran slower


def probe_once() -> float:
    """CPU seconds of this thread for PROBE_REPEATS forward and backward passes of a small
    MLP (`PROBE_BATCH`, `PROBE_WIDTH`)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_BATCH, 64, generator=gen)
    w1 = torch.randn(64, PROBE_WIDTH, generator=gen, requires_grad=True)
    w2 = torch.randn(PROBE_WIDTH, 10, generator=gen, requires_grad=True)
    t0 = time.thread_time()
    for _ in range(PROBE_REPEATS):
        ((x @ w1).relu() @ w2).sum().backward()
    return time.thread_time() - t0


class SpeedProbe:
    """Context manager: samples `probe_once` every `every` seconds (one sample at once) in a
    daemon thread until exit; `samples` holds them. The process must run no multi-threaded
    torch compute of its own meanwhile: the probe runs torch on one thread, and the thread
    count (process-wide) is restored on exit."""

    def __init__(self, every: float = 0.1) -> None:
        if every <= 0:
            raise ValueError(f"a probe's period is positive, not {every}")
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = 0

    def __enter__(self) -> SpeedProbe:
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._sample, name="speed_probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        torch.set_num_threads(self._threads)

    def _sample(self) -> None:
        torch.set_num_threads(1)  # per thread under OpenMP, so here and not in __enter__
        while True:
            self.samples.append(probe_once())
            if self._stop.wait(self.every):
                return

    def median(self) -> float:
        """The median sample (0 where none was taken)."""
        return statistics.median(self.samples) if self.samples else 0.0
