"""The step-time model: layers run in lockstep, so each layer costs its slowest worker.

step = sum over layers l of [ max_w compute(l, w) + max_w exchange(l, w) ], where
compute(l, w) = FLOPs of w's blocks of l (forward + backward) x batch / worker FLOP/s, and
exchange(l, w) = for the forward halo and again for the backward halo (same values, reverse
direction): latency + max(bytes w receives, bytes w sends) / bandwidth, when w has any traffic.
Sends to different peers proceed concurrently (full-duplex links, one NIC per worker).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np

from netpart.errors import PlanError
from netpart.partition.graph import BYTES_PER_VALUE

__all__ = ["NetworkModel", "layer_times"]

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class NetworkModel:
    """Cluster figures the prediction uses. Defaults: 1 Gbit/s Ethernet, 50 µs, 20 GFLOP/s."""

    bandwidth_bps: float = 1e9  # bits per second, per worker link
    latency_s: float = 50e-6  # per exchange phase
    flops_per_s: float = 20e9  # sustained per worker

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> NetworkModel:
        return cls(**{k: float(v) for k, v in data.items()})

    @classmethod
    def parse(cls, text: str) -> NetworkModel:
        """`bandwidth=10Gbit,latency=20us,flops=50G` (any subset) over the defaults."""
        values = asdict(cls())
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip().lower()
            try:
                if key == "bandwidth":
                    m = re.fullmatch(r"([0-9.e+-]+)\s*([kmgt]?)(bit|b)?(/s|ps)?", raw)
                    if not m:
                        raise ValueError
                    values["bandwidth_bps"] = float(m.group(1)) * _UNITS[m.group(2)]
                elif key == "latency":
                    m = re.fullmatch(r"([0-9.e+-]+)\s*(s|ms|us|µs|ns)?", raw)
                    if not m:
                        raise ValueError
                    values["latency_s"] = float(m.group(1)) * _TIME[m.group(2) or "s"]
                elif key == "flops":
                    m = re.fullmatch(r"([0-9.e+-]+)\s*([kmgt]?)(flops?)?(/s)?", raw)
                    if not m:
                        raise ValueError
                    values["flops_per_s"] = float(m.group(1)) * _UNITS[m.group(2)]
                else:
                    raise PlanError(
                        f"--net: unknown key {key!r}; use bandwidth=1Gbit,latency=50us,flops=20G"
                    )
            except ValueError:
                raise PlanError(
                    f"--net: cannot read {item!r}; e.g. bandwidth=10Gbit, latency=20us, flops=50G"
                ) from None
        net = cls(**values)
        if min(net.bandwidth_bps, net.flops_per_s) <= 0 or net.latency_s < 0:
            raise PlanError("--net: bandwidth and flops must be positive, latency >= 0")
        return net


def layer_times(
    flops: np.ndarray, traffic: np.ndarray, batch: int, net: NetworkModel
) -> tuple[np.ndarray, np.ndarray]:
    """(compute_s[l], exchange_s[l]): the slowest worker's time in each layer.

    `flops` is [L, P] per example, `traffic` [L, P, P] units per example (sender, receiver).
    """
    compute = flops.max(axis=1) * batch / net.flops_per_s
    recv = traffic.sum(axis=1)  # [L, P]
    send = traffic.sum(axis=2)
    busy = np.maximum(recv, send) * batch * BYTES_PER_VALUE * 8 / net.bandwidth_bps
    per_worker = np.where(np.maximum(recv, send) > 0, net.latency_s + busy, 0.0)
    return compute, 2.0 * per_worker.max(axis=1)
