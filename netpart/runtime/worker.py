"""ModelWorker: one model worker's lockstep forward and backward pass over a Transport.

Forward, layer by layer: send each owned boundary unit of layer l-1 once to every worker that
reads it, receive the halo into a preallocated buffer, compute the owned units of layer l.
Backward mirrors it: after the local backward of layer l, gradients for halo inputs go back to
their owners, which add them to the gradients of their own units. The loss over a distributed
output layer needs two all-reduces of [B] vectors (max; then sum of exponentials and target
logit, the last two in one call): cross-entropy is computed exactly as on one process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.runtime.schedule import HaloSchedule, ShapeMismatchError
from netpart.runtime.slices import LayerSlice, build_slice, rows
from netpart.runtime.transport import Transport

__all__ = ["ModelWorker", "WorkerResult"]

log = logging.getLogger(__name__)


@dataclass
class WorkerResult:
    """What one worker returns from a step: its loss (same on all), grads and byte counters."""

    rank: int
    loss: float
    outputs: torch.Tensor  # [B, owned output units]
    output_units: np.ndarray
    grads: list[tuple[str, np.ndarray, torch.Tensor]]  # (reference name, flat index, values)
    sent: dict[tuple[int, str], int] = field(default_factory=dict)  # (layer, phase) -> bytes
    received: dict[tuple[int, str], int] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)  # seconds, when timed
    compute_s: dict[tuple[int, str], float] = field(default_factory=dict)  # (layer, phase)
    exchange_s: dict[tuple[int, str], float] = field(default_factory=dict)
    accuracy: float | None = None  # cross-entropy: share of the batch whose target logit is max


class ModelWorker:
    """Holds worker `rank`'s slices of every layer and runs steps through `transport`."""

    def __init__(
        self,
        spec: ModelSpec,
        graph: UnitGraph,
        schedule: HaloSchedule,
        rank: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec, self.schedule, self.rank, self.dtype = spec, schedule, rank, dtype
        self.owned = [schedule.owned[i][rank] for i in range(len(spec.layers))]
        self.slices: list[LayerSlice] = [
            build_slice(spec, i, self.owned[i], graph.layers[i], seed, dtype)
            for i in range(len(spec.layers))
        ]
        # Per layer: what this worker sends (positions in its owned buffer) and receives (units).
        self._owned_t = [torch.from_numpy(u) for u in self.owned]
        self._buffers: dict[tuple[int, str, int], dict[int, torch.Tensor]] = {}
        self.sends: list[dict[int, torch.Tensor]] = [{}]
        self.recvs: list[dict[int, torch.Tensor]] = [{}]
        for i in range(1, len(spec.layers)):
            mine = self.owned[i - 1]
            out: dict[int, torch.Tensor] = {}
            into: dict[int, torch.Tensor] = {}
            for (s, d), units in schedule.sends[i].items():
                if s == rank:
                    out[d] = torch.from_numpy(np.searchsorted(mine, units))
                if d == rank:
                    into[s] = torch.from_numpy(units)
            self.sends.append(out)
            self.recvs.append(into)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for s in self.slices for p in s.parameters()]

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        transport: Transport,
        collect_grads: bool = True,
    ) -> WorkerResult:
        """One forward/backward pass of the whole batch; grads accumulate in the slices.

        With `collect_grads` the result carries copies of the gradients keyed for the
        reference module (costly: leave it off for steps whose gradients stay local).
        """
        batch = inputs.shape[0]
        sent: dict[tuple[int, str], int] = {}
        received: dict[tuple[int, str], int] = {}
        leaves: list[torch.Tensor | None] = []
        outs: list[torch.Tensor] = []
        compute: dict[tuple[int, str], float] = {}
        exchange: dict[tuple[int, str], float] = {}
        clock = time.perf_counter
        t0 = clock()
        x = self._buffer(batch, self.spec.input.shape.size)
        x[: inputs[0].numel()] = inputs.reshape(batch, -1).T.to(self.dtype)
        leaves.append(None)
        outs.append(self.slices[0](x))
        compute[(0, "forward")] = clock() - t0
        for i in range(1, len(self.spec.layers)):
            t0 = clock()
            prev = outs[-1].detach()  # [owned units of layer i-1, B]
            halo = self._receive_buffers(i, "forward", batch)
            payload = {d: rows(prev, pos) for d, pos in self.sends[i].items()}
            transport.exchange(2 * i, payload, halo)
            t1 = clock()
            exchange[(i, "forward")] = t1 - t0
            sent[(i, "forward")] = _nbytes(payload)
            received[(i, "forward")] = _nbytes(halo)
            x = self._buffer(batch, self.spec.input_shape(i).size)
            x.index_copy_(0, self._owned_t[i - 1], prev)
            for s, units in self.recvs[i].items():
                x.index_copy_(0, units, halo[s])
            x.requires_grad_(True)
            leaves.append(x)
            outs.append(self.slices[i](x))
            compute[(i, "forward")] = clock() - t1

        t0 = clock()
        loss, grad, accuracy = self._loss_and_grad(outs[-1], targets, transport)
        exchange[(len(self.spec.layers), "loss")] = clock() - t0
        for i in range(len(self.spec.layers) - 1, -1, -1):
            t0 = clock()
            if outs[i].requires_grad:  # False for a parameter-free layer 0, or no owned units
                torch.autograd.backward(outs[i], grad)
            if i == 0:
                compute[(0, "backward")] = clock() - t0
                break
            gx = leaves[i].grad if leaves[i].grad is not None else torch.zeros_like(leaves[i])
            grad = rows(gx, self._owned_t[i - 1])
            back = {s: rows(gx, units) for s, units in self.recvs[i].items()}
            incoming = self._receive_buffers(i, "backward", batch)
            t1 = clock()
            compute[(i, "backward")] = t1 - t0
            transport.exchange(2 * i + 1, back, incoming)
            exchange[(i, "backward")] = clock() - t1
            sent[(i, "backward")] = _nbytes(back)
            received[(i, "backward")] = _nbytes(incoming)
            for d, pos in self.sends[i].items():
                grad.index_add_(0, pos, incoming[d])
        return WorkerResult(
            rank=self.rank,
            loss=loss,
            outputs=outs[-1].detach().T,
            output_units=self.owned[-1],
            grads=self.collect_grads() if collect_grads else [],
            sent=sent,
            received=received,
            compute_s=compute,
            exchange_s=exchange,
            accuracy=accuracy,
        )

    def collect_grads(self) -> list[tuple[str, np.ndarray, torch.Tensor]]:
        """(reference parameter name, flat index into it, gradient values) of every slice."""
        return [
            (name, idx, p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for s in self.slices
            for name, idx, p in s.param_slices()
        ]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # ---- helpers -------------------------------------------------------------------------
    def _buffer(self, batch: int, n: int) -> torch.Tensor:
        """Input buffer [n + 2, B]: row n is zero padding, row n + 1 is -inf padding."""
        x = torch.zeros(n + 2, batch, dtype=self.dtype)
        x[n + 1] = float("-inf")
        return x

    def _receive_buffers(self, layer: int, phase: str, batch: int) -> dict[int, torch.Tensor]:
        """Receive buffers sized by the schedule, allocated once per (layer, phase, batch).

        Reuse is safe: their contents are copied into the layer's input buffer (forward) or
        added into the gradients (backward) before the next step overwrites them.
        """
        key = (layer, phase, batch)
        if key not in self._buffers:
            peers = self.recvs[layer] if phase == "forward" else self.sends[layer]
            self._buffers[key] = {
                p: torch.empty(len(idx), batch, dtype=self.dtype) for p, idx in peers.items()
            }
        return self._buffers[key]

    def _loss_and_grad(
        self, logits: torch.Tensor, targets: torch.Tensor, transport: Transport
    ) -> tuple[float, torch.Tensor, float | None]:
        """The global loss, its gradient w.r.t. this worker's output units ([U, B]) and the
        batch accuracy (a target logit equal to the global max counts as correct: no extra
        message is needed)."""
        logits = logits.detach().T  # [B, U]
        batch = logits.shape[0]
        units = torch.from_numpy(self.owned[-1])
        if self.spec.loss == "cross_entropy":
            if targets.shape != (batch,):
                raise ShapeMismatchError(
                    f"targets must be [{batch}] class ids, got {targets.shape}"
                )
            local_max = (
                logits.amax(dim=1) if logits.shape[1] else logits.new_full((batch,), -torch.inf)
            )
            gmax = transport.all_reduce(local_max.clone(), "max")
            mine = targets[:, None] == units[None, :]  # [B, |U|]
            # One all-reduce for both sums: [sum of exponentials; target logit].
            sums = torch.stack(
                [torch.exp(logits - gmax[:, None]).sum(dim=1), (logits * mine).sum(dim=1)]
            )
            sumexp, target_logit = transport.all_reduce(sums, "sum")
            lse = gmax + torch.log(sumexp)
            loss = (lse - target_logit).mean()
            grad = (torch.exp(logits - lse[:, None]) - mine.to(logits.dtype)) / batch
            accuracy = float((target_logit >= gmax).to(torch.float64).mean())
            return float(loss), grad.T, accuracy
        n_out = self.spec.shapes[-1].size
        t = targets.reshape(batch, -1).to(self.dtype)[:, units]
        diff = logits - t
        total = transport.all_reduce((diff * diff).sum().reshape(1), "sum")
        return float(total[0] / (batch * n_out)), (2.0 * diff / (batch * n_out)).T, None


def _nbytes(tensors: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
