"""Sandblaster's vectors in a shard: its slices of every vector L-BFGS needs, and the
operations on them. Only reductions (one float) ever leave a shard.

Each shard holds its slice of the parameters `x`, the batch gradient `g`, the previous
gradient, the direction `d`, the two-loop temporary `q`, the line-search base `x0`, and the
last m curvature pairs (s_i, y_i). Vector names travel as numbers (`name_code`).
"""

from __future__ import annotations

import torch

__all__ = ["NAMES", "ShardVectors", "code_name", "name_code"]


NAMES = ("x", "g", "prev_g", "d", "q", "x0", "s_new", "y_new")


def name_code(name: str) -> int:
    """A vector name as a number for the wire: NAMES by index, 's:i' 100 + i, 'y:i' 200 + i."""
    if name[:2] in ("s:", "y:"):
        return (100 if name[0] == "s" else 200) + int(name[2:])
    return NAMES.index(name)


def code_name(code: int) -> str:
    if code >= 200:
        return f"y:{code - 200}"
    if code >= 100:
        return f"s:{code - 100}"
    return NAMES[code]


class ShardVectors:
    """One shard's slices of the L-BFGS vectors, and the operations on them."""

    def __init__(self, values: torch.Tensor, history: int) -> None:
        self.vectors = {name: torch.zeros_like(values) for name in NAMES}
        self.vectors["x"] = values
        self.history = history
        self.s: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []

    def _v(self, name: str) -> torch.Tensor:
        """A named vector, or history pair i as 's:i' / 'y:i'."""
        if name[:2] in ("s:", "y:"):
            return (self.s if name[0] == "s" else self.y)[int(name[2:])]
        return self.vectors[name]

    # reductions: the only results that leave a shard
    def dot(self, a: str, b: str) -> float:
        return float(torch.dot(self._v(a), self._v(b)))

    def abs_sum(self, a: str) -> float:
        return float(self._v(a).abs().sum())

    def abs_max(self, a: str) -> float:
        v = self._v(a)
        return float(v.abs().max()) if v.numel() else 0.0

    # updates in place
    def axpy(self, alpha: float, a: str, b: str) -> None:
        """b += alpha * a"""
        self._v(b).add_(self._v(a), alpha=alpha)

    def copy(self, src: str, dst: str) -> None:
        self._v(dst).copy_(self._v(src))

    def scale(self, name: str, alpha: float) -> None:
        self._v(name).mul_(alpha)

    def diff(self, a: str, b: str, out: str) -> None:
        """out = a - b"""
        torch.sub(self._v(a), self._v(b), out=self._v(out))

    def keep_pair(self) -> None:
        """Append (s_new, y_new) to the history, dropping the oldest pair when full."""
        if len(self.s) == self.history:
            self.s.pop(0)
            self.y.pop(0)
        self.s.append(self.vectors["s_new"].clone())
        self.y.append(self.vectors["y_new"].clone())

    def run(self, op: str, alpha: float, a: str, b: str, c: str) -> float:
        """One operation by name (a coordinator command); reductions return their value."""
        if op == "dot":
            return self.dot(a, b)
        if op == "abs_sum":
            return self.abs_sum(a)
        if op == "abs_max":
            return self.abs_max(a)
        if op == "axpy":
            self.axpy(alpha, a, b)
        elif op == "copy":
            self.copy(a, b)
        elif op == "scale":
            self.scale(a, alpha)
        elif op == "diff":
            self.diff(a, b, c)
        elif op == "keep_pair":
            self.keep_pair()
        return 0.0
