"""Update rules a parameter-server shard applies to its flat range of parameters.

`sgd`: p -= lr * g. `adagrad` (the paper's choice: a learning rate per parameter): the same
arithmetic as `torch.optim.Adagrad` with its defaults (no decay, zero initial accumulator):
s += g * g; p -= lr * g / (sqrt(s) + eps). Rules apply to a segment [lo, lo + len(g)) so a
shard can update the part of its range one push covers without touching the rest.

Delay compensation (DC-ASGD, Zheng et al. 2017), for Downpour: a gradient g computed on
values w_bak that have since become w is first corrected to g + lambda * g * g * (w - w_bak),
a cheap first-order estimate of the gradient at w; then the rule applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OPTIMIZERS", "Optimizer", "UpdateRule", "delay_compensated"]

_FUSED = getattr(torch, "_fused_adagrad_", None)  # the kernel of Adagrad(fused=True) on CPU

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

    @property
    def has_state(self) -> bool:
        return self.name == "adagrad"


class UpdateRule:
    """Owns a shard's parameter values and optimizer state; `apply` updates one segment."""

    def __init__(
        self, optimizer: Optimizer, values: torch.Tensor, state: torch.Tensor | None = None
    ) -> None:
        self.optimizer, self.values = optimizer, values
        if optimizer.has_state and state is None:
            state = torch.zeros_like(values)
        self.state = state if optimizer.has_state else None
        self._steps = torch.zeros(())  # the fused kernel's step counter (unused without decay)

    def apply(self, lo: int, grad: torch.Tensor) -> None:
        p = self.values[lo : lo + grad.numel()]
        lr = self.optimizer.lr
        if self.state is None:
            p.add_(grad, alpha=-lr)
            return
        s = self.state[lo : lo + grad.numel()]
        if _FUSED is not None:  # one pass over memory; the same arithmetic per element
            _FUSED(
                [p], [grad], [s], [self._steps], lr=lr, lr_decay=0.0, weight_decay=0.0,
                eps=self.optimizer.eps, maximize=False,
            )  # fmt: skip
            return
        s.addcmul_(grad, grad, value=1.0)
        p.addcdiv_(grad, s.sqrt().add_(self.optimizer.eps), value=-lr)


def delay_compensated(
    grad: torch.Tensor, now: torch.Tensor, then: torch.Tensor, lam: float
) -> torch.Tensor:
    """g + lam * g * g * (now - then): the DC-ASGD correction of a stale gradient."""
    return grad + lam * grad * grad * (now - then)
