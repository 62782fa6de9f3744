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
from dataclasses import asdict, dataclass

__all__ = ["DEFAULT_GAIN", "SweepResult", "knee", "parse_counts"]

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
