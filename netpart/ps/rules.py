"""Update rules a shard applies to its flat range of parameters, as small objects.

`Sgd`: p -= lr * g. `Adagrad` (the paper's choice: a learning rate per parameter): the same
arithmetic as `torch.optim.Adagrad` with its defaults (no decay, zero initial accumulator):
s += g * g; p -= lr * g / (sqrt(s) + eps). A rule applies to a segment [lo, lo + len(g)), so a
shard can update the part of its range one push chunk covers without touching the rest.

`DelayCompensation` (DC-ASGD, Zheng et al. 2017), for Downpour: a gradient g computed on
values w_bak that have since become w is first corrected to g + lambda * g * g * (w - w_bak),
a cheap first-order estimate of the gradient at w; then the rule applies.
"""

from __future__ import annotations

from typing import Protocol

import torch

from netpart.ps.optimizer import OPTIMIZERS, Optimizer

__all__ = [
    "OPTIMIZERS",
    "Adagrad",
    "DelayCompensation",
    "Optimizer",
    "Sgd",
    "UpdateRule",
    "make_rule",
]

_FUSED = getattr(torch, "_fused_adagrad_", None)  # the kernel of Adagrad(fused=True) on CPU

DC_KEPT = 4  # DC-ASGD: served versions kept per peer


class UpdateRule(Protocol):
    values: torch.Tensor  # the shard's values (updated in place)
    state: torch.Tensor | None  # what a checkpoint keeps besides the values

    def apply(self, lo: int, grad: torch.Tensor) -> None:
        """Update values[lo : lo + len(grad)] with `grad`."""


class Sgd:
    def __init__(self, lr: float, values: torch.Tensor) -> None:
        self.lr, self.values, self.state = lr, values, None

    def apply(self, lo: int, grad: torch.Tensor) -> None:
        self.values[lo : lo + grad.numel()].add_(grad, alpha=-self.lr)


class Adagrad:
    def __init__(
        self, lr: float, eps: float, values: torch.Tensor, state: torch.Tensor | None = None
    ) -> None:
        self.lr, self.eps, self.values = lr, eps, values
        self.state = torch.zeros_like(values) if state is None else state
        self._steps = torch.zeros(())  # the fused kernel's step counter (unused without decay)

    def apply(self, lo: int, grad: torch.Tensor) -> None:
        p = self.values[lo : lo + grad.numel()]
        s = self.state[lo : lo + grad.numel()]
        if _FUSED is not None:  # one pass over memory; the same arithmetic per element
            _FUSED(
                [p],
                [grad],
                [s],
                [self._steps],
                lr=self.lr,
                lr_decay=0.0,
                weight_decay=0.0,
                eps=self.eps,
                maximize=False,
            )
            return
        s.addcmul_(grad, grad, value=1.0)
        p.addcdiv_(grad, s.sqrt().add_(self.eps), value=-self.lr)


def make_rule(
    optimizer: Optimizer, values: torch.Tensor, state: torch.Tensor | None = None
) -> UpdateRule:
    """The rule `optimizer` names, over `values` (and a checkpoint's `state`). L-BFGS shards
    hold their values in an `Sgd` they never apply: the coordinator moves x by vector ops."""
    if optimizer.name == "adagrad":
        return Adagrad(optimizer.lr, optimizer.eps, values, state)
    return Sgd(optimizer.lr, values)


class DelayCompensation:
    """DC-ASGD: keeps the values each peer was served (its `DC_KEPT` newest versions) and
    corrects a push computed on one of them."""

    def __init__(self, lam: float) -> None:
        self.lam = lam
        self.served: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def remember(self, peer: tuple[int, int], version: int, values: torch.Tensor) -> None:
        kept = self.served.setdefault(peer, {})
        kept[version] = values.clone()
        while len(kept) > DC_KEPT:
            kept.pop(min(kept))

    def served_values(self, peer: tuple[int, int], version: int) -> torch.Tensor | None:
        """The values a push from `peer` computed on `version` was computed on, if kept."""
        return self.served.get(peer, {}).get(version)

    def correct(self, grad: torch.Tensor, now: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
        """g + lambda * g * g * (now - then)."""
        return grad + self.lam * grad * grad * (now - then)
