"""Whether a calibration can be trusted: the machine's load while it ran, and what it fitted.

A calibration measures this machine; another job on it (or a host stealing its vCPUs) makes
every figure slower by an amount that is gone an hour later, and the fitted terms say so in
their own way: two workers' compute "x2.6" slower than one's. So `netpart calibrate`

- samples the machine between its measurements, while it runs nothing itself (`sample`):
  the cores other processes kept busy (/proc/stat) and the share the hypervisor stole;
- reads the spread of its own runs (the same step measured `repeats` times);
- checks the fitted terms against what a quiet machine gives (`implausible`);

and the `Verdict` of all three decides: a calibration on a busy machine is repeated once,
then refused (`--force` keeps it, marked in the profile: every prediction made with it says
so).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from netpart.cost.machine import Machine

__all__ = [
    "BUSY_CORES",
    "BUSY_STEAL",
    "RUN_SPREAD",
    "LoadSample",
    "Verdict",
    "implausible",
    "sample",
    "verdict",
]

BUSY_CORES = 0.3  # cores other processes keep busy (on average) beyond which a machine is busy
BUSY_STEAL = 0.05  # share of CPU time the hypervisor stole beyond which a machine is busy
RUN_SPREAD = 1.5  # a case's slowest run over its fastest beyond which its median is doubtful
# What the fitted terms are on a quiet machine (a term outside is a sign of a busy one).
PLAUSIBLE = {
    "compute slowdown with two workers": (0.8, 1.8),
    "slice time in a step over alone": (0.5, 2.0),
}


@dataclass(frozen=True)
class LoadSample:
    """The machine over `seconds` while calibration ran nothing: the cores others kept busy
    and the share of CPU time stolen."""

    seconds: float
    others_cores: float
    steal: float
    loadavg: float

    def busy(self) -> bool:
        return self.others_cores > BUSY_CORES or self.steal > BUSY_STEAL

    def describe(self) -> str:
        return (
            f"{self.others_cores:.2f} cores busy with other work, {self.steal:.0%} stolen, "
            f"load average {self.loadavg:.2f}"
        )


def _cpu_jiffies() -> tuple[float, float, float] | None:
    """(busy, steal, total) jiffies of all CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0.0
    total = sum(fields[:8])
    return total - idle - steal, steal, total


def sample(seconds: float = 1.0) -> LoadSample:
    """The machine's load over `seconds` of this process sleeping (its threads idle)."""
    clock = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    first, t0 = _cpu_jiffies(), time.monotonic()
    time.sleep(seconds)
    last, wall = _cpu_jiffies(), time.monotonic() - t0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if first is None or last is None:
        return LoadSample(wall, 0.0, 0.0, load)
    busy, steal, total = (b - a for a, b in zip(first, last, strict=True))
    return LoadSample(wall, busy / clock / wall, steal / total if total else 0.0, load)


def implausible(model: Machine) -> list[str]:
    """The fitted terms outside what a quiet machine gives, in words."""
    terms = {
        "compute slowdown with two workers": 1 + model.parallel_slowdown,
        "slice time in a step over alone": model.slice_scale,
    }
    out = []
    for name, value in terms.items():
        low, high = PLAUSIBLE[name]
        if not low <= value <= high:
            out.append(f"{name} x{value:.2f} (a quiet machine gives {low:g}-{high:g})")
    return out


@dataclass(frozen=True)
class Verdict:
    """Whether a calibration can be trusted, and if not, why (one reason a line)."""

    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def trusted(self) -> bool:
        return not self.reasons

    def caveat(self) -> str:
        """What a prediction made with the profile says about it ("" when trusted)."""
        return "" if self.trusted else "calibrated on a busy machine: " + "; ".join(self.reasons)


def verdict(samples: list[LoadSample], spreads: list[float], model: Machine) -> Verdict:
    """The verdict of the machine's load between measurements (`samples`: the median
    decides, one outlier does not), the runs' spread (each case's slowest over fastest: the
    median decides) and the fitted terms."""
    reasons = []
    if samples:
        cores = float(np.median([s.others_cores for s in samples]))
        steal = float(np.median([s.steal for s in samples]))
        if cores > BUSY_CORES:
            reasons.append(
                f"other processes kept {cores:.2f} cores busy (median of "
                f"{len(samples)} samples; at most {BUSY_CORES:g})"
            )
        if steal > BUSY_STEAL:
            reasons.append(
                f"the hypervisor stole {steal:.0%} of CPU time (at most {BUSY_STEAL:.0%})"
            )
    if spreads and float(np.median(spreads)) > RUN_SPREAD:
        reasons.append(
            f"repeated runs of a step differed {float(np.median(spreads)):.2f}x "
            f"(median slowest over fastest; at most {RUN_SPREAD:g}x)"
        )
    reasons += [f"implausible {x}" for x in implausible(model)]
    return Verdict(tuple(reasons))
