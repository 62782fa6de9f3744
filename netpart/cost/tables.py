"""Slice tables: a calibrated machine's measured slice times, per layer kind (`KindCost`) and
per layer (`LayerCost`), read at any size; `netpart.cost.step` turns them into compute
times. Each table is non-decreasing in FLOPs (a slower point among faster larger ones is
pooled with them) and is read piecewise linearly between its sizes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

__all__ = [
    "FORWARD_SHARE",
    "NEAR",
    "KindCost",
    "LayerCost",
    "read_pooled",
    "read_table",
    "table_points",
]

FORWARD_SHARE = 1.0 / 3.0  # of a slice's time, its forward pass, where nothing was measured
NEAR = 1.3  # a layer's slices within this factor of its smallest (largest) give its rate there


def table_points(raw, what: str) -> tuple[tuple[float, float], ...]:
    """Sorted (size, seconds) pairs of a table read from JSON; ValueError if not positive."""
    pts = tuple(sorted((float(x), float(t)) for x, t in raw))
    if any(x <= 0 or t <= 0 for x, t in pts):
        raise ValueError(f"{what} needs positive (size, seconds) points")
    return pts


def read_table(table: tuple[tuple[float, float], ...], x: np.ndarray) -> np.ndarray:
    """A (size, seconds) table read at `x`: piecewise linear (each time at most those of the
    larger sizes: a slow outlier at a small size is noise, as no message costs more than a
    larger one, nor a collective among fewer workers more than among more), the smallest
    size's time below it, the last segment's rate above it."""
    b, t = np.array(table, dtype=np.float64).T
    return _read(b, np.minimum.accumulate(t[::-1])[::-1], x)


def read_pooled(table: tuple[tuple[float, float], ...], x: np.ndarray) -> np.ndarray:
    """A (size, seconds) table read at `x` as `read_table` reads one, but made non-decreasing
    by least squares (a run that falls is pooled into its mean) instead of by the fastest
    larger size: for a table whose larger sizes can run faster as a rule, not as an outlier
    (a ring all-reduce on machines held to a share of a core: docs/planning.md), where the
    lower envelope would price every smaller size at that one fast point."""
    b, t = np.array(table, dtype=np.float64).T
    return _read(b, _non_decreasing(t), x)


def _read(b: np.ndarray, t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Non-decreasing times `t` at sizes `b`, read at `x`: piecewise linear, the smallest
    size's time below them, the last segment's rate above them."""
    rate = (t[-1] - t[-2]) / (b[-1] - b[-2]) if len(b) > 1 else 0.0
    above = t[-1] + (x - b[-1]) * (rate if rate > 0 else t[-1] / b[-1])
    return np.where(x > b[-1], above, np.interp(x, b, t))


def _non_decreasing(t: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest `t` in least squares (pool adjacent violators:
    a run that falls is replaced by its mean; a loop over a table's few points)."""
    means: list[float] = []
    counts: list[int] = []
    for v in t:
        means.append(float(v))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            n = counts[-2] + counts[-1]
            means[-2:] = [(means[-2] * counts[-2] + means[-1] * counts[-1]) / n]
            counts[-2:] = [n]
    return np.repeat(means, counts)


@dataclass(frozen=True)
class KindCost:
    """A layer kind's measured slice times: (FLOPs x batch, seconds forward+backward) points
    of this machine's slices, sorted, less `per_value` x the input values (x batch) each slice
    gathered; a slice's time is read off them, plus its own values' share (see `seconds`)."""

    points: tuple[tuple[float, float], ...]
    forward_share: float = FORWARD_SHARE  # of a slice's time, its forward pass (median measured)
    per_value: float = 0.0  # seconds per input value (x batch) a slice gathers

    @cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(sizes, seconds, seconds per FLOP above them) of `seconds`, computed once."""
        f, t = np.array(sorted(self.points), dtype=np.float64).T
        f, first = np.unique(f, return_index=True)
        t = np.array([np.median(s) for s in np.split(t, first[1:])])
        return f, _non_decreasing(t), float(np.median(t[-3:] / f[-3:]))

    def seconds(self, work: np.ndarray, values: np.ndarray | float = 0.0) -> np.ndarray:
        """Seconds of slices of `work` FLOPs that gather `values` input values (both x batch):
        `per_value` x values, plus piecewise linear between measured points (one time per
        size, their median; made non-decreasing by least squares), the smallest size's time
        below them (a slice's fixed cost dominates there), and above them the largest time
        plus the median seconds per FLOP of the three largest sizes, so one slow slice cannot
        scale every larger prediction."""
        f, t, rate = self._table
        table = np.where(work > f[-1], t[-1] + rate * (work - f[-1]), np.interp(work, f, t))
        return table + self.per_value * np.asarray(values, dtype=np.float64)

    @property
    def floor_s(self) -> float:
        """The smallest slice's seconds: what any slice of this kind costs (`seconds`
        below the measured sizes)."""
        return float(self.seconds(np.zeros(1))[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [list(p) for p in self.points],
            "forward_share": self.forward_share,
            "per_value": self.per_value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KindCost:
        pts = table_points(data["points"], "a kind")
        if not pts:
            raise ValueError("a kind needs positive (flops, seconds) points")
        share = float(data.get("forward_share", FORWARD_SHARE))
        if not 0.0 < share < 1.0:
            raise ValueError("a kind's forward_share is between 0 and 1")
        per_value = float(data.get("per_value", 0.0))
        if not per_value >= 0.0:
            raise ValueError("a kind's per_value is >= 0")
        return cls(pts, share, per_value)


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured slice times (its `ModelSpec.layer_key`): (FLOPs x batch, seconds)
    of slices of that very layer. A kind's table mixes layers whose slices of equal FLOPs run
    at different rates (a local layer over 48 input channels at 11 GFLOP/s, one over 3 at 7);
    a layer's own table does not. Read like a kind's table between its sizes, and beyond them
    in proportion to the FLOPs at the rate of its nearest slices, never below `floor_s` (the
    kind's smallest slice: what any slice costs)."""

    points: tuple[tuple[float, float], ...]
    floor_s: float = 0.0

    @cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """(sizes, seconds, seconds per FLOP at the smallest and at the largest sizes)."""
        f, t = np.array(sorted(self.points), dtype=np.float64).T
        small, large = f <= f[0] * NEAR, f >= f[-1] / NEAR
        rates = (float(np.median(t[m] / f[m])) for m in (small, large))
        sizes, first = np.unique(f, return_index=True)
        seconds = np.array([np.median(s) for s in np.split(t, first[1:])])
        return sizes, _non_decreasing(seconds), *rates

    def seconds(self, work: np.ndarray) -> np.ndarray:
        """Seconds of slices of this layer of `work` FLOPs (x batch)."""
        f, t, small, large = self._table
        work = np.asarray(work, dtype=np.float64)
        inside = np.interp(work, f, t)
        out = np.where(work < f[0], work * small, np.where(work > f[-1], work * large, inside))
        return np.maximum(out, self.floor_s)

    def scaled(self, factor: float) -> LayerCost:
        """The same table with every slice `factor` times as long (the floor kept)."""
        return replace(self, points=tuple((f, t * factor) for f, t in self.points))

    def to_dict(self) -> dict[str, Any]:
        return {"points": [list(p) for p in self.points], "floor_s": self.floor_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerCost:
        pts = table_points(data["points"], "a layer")
        floor = float(data.get("floor_s", 0.0))
        if not pts or not floor >= 0.0:
            raise ValueError("a layer needs positive (flops, seconds) points and floor_s >= 0")
        return cls(pts, floor)
