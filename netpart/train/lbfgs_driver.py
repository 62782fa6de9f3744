"""Sandblaster's L-BFGS driver: the coordinator's logic over shard-held vectors.

The vectors — the parameters `x`, the batch gradient `g`, the previous gradient, the
direction `d`, the line-search base `x0`, the two-loop temporary `q` and the last m curvature
pairs (s_i, y_i) — live in the parameter-server shards
(`netpart.ps.lbfgs_vectors.ShardVectors`). The
driver (`LBFGSDriver`) issues vector operations on them and receives only the results of
reductions (dot products, sums and maxima of magnitudes), so no parameter vector ever
reaches it.

With `line_search=None` the driver performs exactly the iterations of
`torch.optim.LBFGS(lr, history_size=m, line_search_fn=None)` (the same first step
min(1, 1/|g|_1) * lr, curvature condition y.s > 1e-10, scaling H = y.s / y.y, two-loop
recursion and stopping rules); `line_search="armijo"` backtracks t <- t * `shrink` until
f(x + t d) <= f(x) + c1 * t * g.d.

`LocalShards` holds shards in this process (for tests); the distributed coordinator
(`netpart.train.sandblaster.RemoteShards`) puts the same calls on the wire. `evaluate()`
stands for a batch of gradient work: it must leave the gradient of the loss at the shards'
current `x` in their `g` and return the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from netpart.ps.lbfgs_vectors import ShardVectors

__all__ = ["LBFGSDriver", "LBFGSResult", "LocalShards"]


class LocalShards:
    """The driver's view of S shards held in this process: every operation goes to every
    shard, reductions are summed (or maxed); `scalars` counts the numbers returned."""

    def __init__(self, shards: Sequence[ShardVectors]) -> None:
        self.shards = list(shards)
        self.scalars = 0

    def _reduce(self, results: list[float], how: Callable = sum) -> float:
        self.scalars += len(results)
        return float(how(results))

    def dot(self, a: str, b: str) -> float:
        return self._reduce([s.dot(a, b) for s in self.shards])

    def abs_sum(self, a: str) -> float:
        return self._reduce([s.abs_sum(a) for s in self.shards])

    def abs_max(self, a: str) -> float:
        return self._reduce([s.abs_max(a) for s in self.shards], max)

    def axpy(self, alpha: float, a: str, b: str) -> None:
        for s in self.shards:
            s.axpy(alpha, a, b)

    def copy(self, src: str, dst: str) -> None:
        for s in self.shards:
            s.copy(src, dst)

    def scale(self, name: str, alpha: float) -> None:
        for s in self.shards:
            s.scale(name, alpha)

    def diff(self, a: str, b: str, out: str) -> None:
        for s in self.shards:
            s.diff(a, b, out)

    def keep_pair(self) -> None:
        for s in self.shards:
            s.keep_pair()


@dataclass
class LBFGSResult:
    """How a run of the driver went: losses after each evaluation, and why it stopped."""

    losses: list[float] = field(default_factory=list)
    iterations: int = 0
    evaluations: int = 0
    backtracks: int = 0
    stopped: str = "max_iter"


@dataclass
class LBFGSDriver:
    """L-BFGS over shard-held vectors (see the module docstring)."""

    shards: LocalShards
    evaluate: Callable[[], float]
    lr: float = 1.0
    history: int = 10
    line_search: str | None = None  # None (torch's fixed step) | "armijo"
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    c1: float = 1e-4
    shrink: float = 0.5
    max_backtracks: int = 20
    ro: list[float] = field(default_factory=list)  # 1 / y.s of each kept pair
    h_diag: float = 1.0
    should_stop: Callable[[], bool] | None = None  # asked before each iteration ("signal")

    def run(self, max_iter: int) -> LBFGSResult:
        """Up to `max_iter` iterations from the shards' current x (torch's loop and stops)."""
        sh, out = self.shards, LBFGSResult()
        loss = self.evaluate()
        out.evaluations, out.losses = 1, [loss]
        if sh.abs_max("g") <= self.tolerance_grad:
            out.stopped = "gradient"
            return out
        t, prev_loss = 0.0, loss
        for n in range(1, max_iter + 1):
            if self.should_stop is not None and self.should_stop():
                out.stopped = "signal"  # x is the last point evaluated: a clean stop
                break
            out.iterations = n
            if n == 1:
                sh.copy("g", "d")
                sh.scale("d", -1.0)
            else:
                self._update_history(t)
                self._two_loop()
            sh.copy("g", "prev_g")
            prev_loss = loss
            t = min(1.0, 1.0 / sh.abs_sum("g")) * self.lr if n == 1 else self.lr
            gtd = sh.dot("g", "d")
            if gtd > -self.tolerance_change:
                out.stopped = "direction"
                break
            if self.line_search == "armijo":
                loss, t, tries = self._armijo(loss, t, gtd)
                out.evaluations += tries
                out.backtracks += tries - 1
            else:
                sh.axpy(t, "d", "x")
                if n != max_iter:
                    loss = self.evaluate()
                    out.evaluations += 1
            out.losses.append(loss)
            if n == max_iter:
                break
            if sh.abs_max("g") <= self.tolerance_grad:
                out.stopped = "gradient"
                break
            if sh.abs_max("d") * abs(t) <= self.tolerance_change:
                out.stopped = "step"
                break
            if abs(loss - prev_loss) < self.tolerance_change:
                out.stopped = "loss"
                break
        return out

    def _update_history(self, t: float) -> None:
        sh = self.shards
        sh.diff("g", "prev_g", "y_new")
        sh.copy("d", "s_new")
        sh.scale("s_new", t)
        ys = sh.dot("y_new", "s_new")
        if ys > 1e-10:
            if len(self.ro) == self.history:
                self.ro.pop(0)
            sh.keep_pair()
            self.ro.append(1.0 / ys)
            self.h_diag = ys / sh.dot("y_new", "y_new")

    def _two_loop(self) -> None:
        """d = -H g by the two-loop recursion, over the kept pairs."""
        sh, k = self.shards, len(self.ro)
        sh.copy("g", "q")
        sh.scale("q", -1.0)
        al = [0.0] * k
        for i in range(k - 1, -1, -1):
            al[i] = sh.dot(f"s:{i}", "q") * self.ro[i]
            sh.axpy(-al[i], f"y:{i}", "q")
        sh.copy("q", "d")
        sh.scale("d", self.h_diag)
        for i in range(k):
            be = sh.dot(f"y:{i}", "d") * self.ro[i]
            sh.axpy(al[i] - be, f"s:{i}", "d")

    def _armijo(self, loss: float, t: float, gtd: float) -> tuple[float, float, int]:
        """Backtrack from step t until the sufficient-decrease condition holds."""
        sh = self.shards
        sh.copy("x", "x0")
        for tries in range(1, self.max_backtracks + 1):
            sh.copy("x0", "x")
            sh.axpy(t, "d", "x")
            trial = self.evaluate()
            if trial <= loss + self.c1 * t * gtd or tries == self.max_backtracks:
                return trial, t, tries
            t *= self.shrink
        raise AssertionError("unreachable")  # pragma: no cover
