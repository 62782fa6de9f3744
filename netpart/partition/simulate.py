"""Trace-driven step time: measured slice times on the lockstep critical path of a plan.

The runtime runs layers in lockstep: in the forward pass each layer first exchanges its halo,
then every worker computes its slice; the backward pass mirrors it. So

  step = sum_l [ F(l) + B(l) ] + sum_l X(l) + loss,

where F(l) (B(l)) is the slowest worker's measured forward (backward) time of layer l, X(l)
the forward and backward halo exchange of layer l from the plan's traffic and a network model
(`netpart.partition.cost.layer_times`: latency + the busier direction's bytes / bandwidth,
sends to different peers concurrent), and `loss` the two all-reduces of [B] vectors of the
distributed cross-entropy (a binomial tree: ceil(log2 N) latencies each way). With `cores`
set, N workers share that many cores: a layer then takes at least the sum of its slices'
times over `cores` (what running N processes on a small machine gives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from netpart.partition.cost import NetworkModel, layer_times
from netpart.partition.graph import BYTES_PER_VALUE

__all__ = ["SimulatedStep", "simulate_step"]


@dataclass(frozen=True)
class SimulatedStep:
    """Predicted seconds of one step and its parts (per layer: compute and exchange)."""

    step_s: float
    compute_s: float
    exchange_s: float
    loss_s: float
    layer_compute_s: tuple[float, ...]
    layer_exchange_s: tuple[float, ...]

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "exchange_s": self.exchange_s,
            "loss_s": self.loss_s,
            "layer_compute_s": list(self.layer_compute_s),
            "layer_exchange_s": list(self.layer_exchange_s),
        }


def simulate_step(
    forward: np.ndarray,
    backward: np.ndarray,
    traffic: np.ndarray,
    batch: int,
    net: NetworkModel,
    cores: int | None = None,
) -> SimulatedStep:
    """The step time of a plan whose slices took `forward`/`backward` [L, N] seconds and
    whose halo moves `traffic` [L, N, N] values per example (sender, receiver)."""
    forward, backward = np.asarray(forward, float), np.asarray(backward, float)
    if forward.shape != backward.shape or traffic.shape != (*forward.shape, forward.shape[1]):
        raise ValueError(
            f"shapes disagree: forward {forward.shape}, backward {backward.shape}, "
            f"traffic {traffic.shape}"
        )
    workers = forward.shape[1]
    compute = _lockstep(forward, cores) + _lockstep(backward, cores)
    _, exchange = layer_times(np.zeros_like(forward), traffic, batch, net)
    loss = 0.0
    if workers > 1:
        hops = math.ceil(math.log2(workers))
        vector = 2 * batch * BYTES_PER_VALUE * 8 / net.bandwidth_bps  # [B] max, then [2, B] sum
        loss = 2 * hops * (2 * net.latency_s + vector)  # two all-reduces: reduce + broadcast
    return SimulatedStep(
        step_s=float(compute.sum() + exchange.sum() + loss),
        compute_s=float(compute.sum()),
        exchange_s=float(exchange.sum()),
        loss_s=loss,
        layer_compute_s=tuple(compute.tolist()),
        layer_exchange_s=tuple(exchange.tolist()),
    )


def _lockstep(times: np.ndarray, cores: int | None) -> np.ndarray:
    """Per layer: the slowest worker, or on `cores` shared cores at least the total / cores."""
    slowest = times.max(axis=1)
    if cores is None or cores >= times.shape[1]:
        return slowest
    return np.maximum(slowest, times.sum(axis=1) / cores)
