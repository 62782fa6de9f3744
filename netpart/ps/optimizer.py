"""Which update rule a job's shards apply, and its hyper-parameters (no torch: the config
and the command line read it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZERS", "Optimizer"]

OPTIMIZERS = ("sgd", "adagrad", "lbfgs")  # lbfgs: Sandblaster, driven by the coordinator


@dataclass(frozen=True)
class Optimizer:
    """Which rule and its hyper-parameters (part of the training config and checkpoints)."""

    name: str = "adagrad"
    lr: float = 0.01
    eps: float = 1e-10

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
