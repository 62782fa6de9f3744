"""What one worker's step reads and writes as its program runs, and what it returns.

`StepState` holds the step's tensors: activations forward (`Activations`), gradients and
backward roots (`Gradients`), and the messages in flight; `Ledger` books where its bytes and
seconds went, per (layer, phase), and by category (`BREAKDOWN`); `WorkerResult` is what a
worker returns from a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from netpart.compile.program import Instruction
from netpart.models.dropout import DropoutKey
from netpart.runtime.transport import Handle, Transport

__all__ = [
    "BREAKDOWN",
    "Activations",
    "Gradients",
    "Ledger",
    "StepState",
    "WorkerResult",
    "book_key",
]

BREAKDOWN = ("slice", "fill", "post", "wait", "loss")
Key = tuple[int, str]  # (layer, phase): plain strings, saved in files loaded weights_only


def book_key(ins: Instruction) -> Key:
    """The (layer, phase) an instruction's figures are booked under."""
    return ins.layer, str(ins.phase)


@dataclass
class WorkerResult:
    """What one worker returns from a step: its loss (same on all), grads and byte counters."""

    rank: int
    loss: float
    outputs: torch.Tensor  # [B, owned output units]
    output_units: np.ndarray
    grads: list[tuple[str, np.ndarray, torch.Tensor]]  # (reference name, flat index, values)
    sent: dict[Key, int] = field(default_factory=dict)  # (layer, phase) -> bytes
    received: dict[Key, int] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)  # seconds, when timed
    compute_s: dict[Key, float] = field(default_factory=dict)  # (layer, phase)
    exchange_s: dict[Key, float] = field(default_factory=dict)  # exposed
    hidden_s: dict[Key, float] = field(default_factory=dict)  # behind compute
    breakdown: dict[str, float] = field(default_factory=dict)  # category -> seconds
    accuracy: float | None = None  # cross-entropy: share of the batch whose target logit is max
    stop: bool = False  # some worker of the replica asked to stop after this step
    # batch norms' running statistics it holds: (reference buffer name, channels, values)
    statistics: list[tuple[str, np.ndarray, torch.Tensor]] = field(default_factory=list)


@dataclass
class Activations:
    """The forward pass's tensors, per layer."""

    outs: dict[int, torch.Tensor] = field(default_factory=dict)  # owned outputs [U, B]
    # a whole layer's outputs as planes [B, C, H, W] (`outs` is a view of them): a whole
    # layer above reads these, not the view, so autograd sees no transposes between them
    planes: dict[int, torch.Tensor] = field(default_factory=dict)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # its input (autograd leaf)
    pieces: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # interior outputs
    # Producer chains: each part's activated outputs (its backward root), the early and late
    # outputs in units order, and each layer's input while its parts are computed.
    parts: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    early_out: dict[int, torch.Tensor] = field(default_factory=dict)
    late_out: dict[int, torch.Tensor] = field(default_factory=dict)
    chain_inputs: dict[int, torch.Tensor] = field(default_factory=dict)


Root = tuple[torch.Tensor, torch.Tensor | None, list]  # (outputs, gradient, parameters)


@dataclass
class Gradients:
    """The backward pass's tensors. A backward call starts from a root: a joined layer's root
    waits for the layer below (`pending`); a layer whose input gradient went first keeps its
    root for its weights (`roots`)."""

    pending: Root | None = None
    roots: dict[int, Root] = field(default_factory=dict)
    grad: dict[int, torch.Tensor] = field(default_factory=dict)  # of a layer's owned outputs
    back: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # owner -> halo grad


@dataclass
class Ledger:
    """Where a step's bytes and seconds went: per (layer, phase) bytes sent and received,
    compute, exposed and hidden exchange; and seconds by category (`BREAKDOWN`)."""

    sent: dict[Key, int] = field(default_factory=dict)
    received: dict[Key, int] = field(default_factory=dict)
    compute: dict[Key, float] = field(default_factory=dict)
    exchange: dict[Key, float] = field(default_factory=dict)
    hidden: dict[Key, float] = field(default_factory=dict)
    first_post: dict[Key, float] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BREAKDOWN, 0.0))

    @staticmethod
    def add(book: dict, at, value) -> None:
        book[at] = book.get(at, 0) + value

    def figures(self) -> dict:
        """The ledger as `WorkerResult`'s fields."""
        return {
            "sent": self.sent,
            "received": self.received,
            "compute_s": self.compute,
            "exchange_s": self.exchange,
            "hidden_s": self.hidden,
            "breakdown": self.breakdown,
        }


@dataclass
class StepState:
    """Everything one step's instructions read and write."""

    inputs: torch.Tensor
    targets: torch.Tensor
    transport: Transport
    flag: float  # 1.0: this worker asks its replica to stop after the step
    want_accuracy: bool = True
    dropout: DropoutKey | None = None  # a training step's masks; None: no dropout
    fwd: Activations = field(default_factory=Activations)
    bwd: Gradients = field(default_factory=Gradients)
    posted: dict[Key, list[Handle]] = field(default_factory=dict)  # messages in flight
    book: Ledger = field(default_factory=Ledger)
    loss: float = 0.0
    accuracy: float | None = None
    stop: bool = False

    @property
    def batch(self) -> int:
        return self.inputs.shape[0]
