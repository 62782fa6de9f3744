"""ModelWorker: one model worker, an interpreter of its program from the halo schedule.

The worker holds its slices of every layer and runs `schedule.instructions(rank)` — the
program `HaloSchedule.validate` checked before any process started — one instruction at a
time: compute a layer (or part of one), post a halo send or receive, wait for a phase's
messages, compute the loss. It derives no order of its own, so what runs is what was
validated.

Forward, a layer's input buffer holds the owned units of the layer below and the halo received
from their owners; backward, the gradient w.r.t. halo inputs goes back to their owners, which
add it to the gradients of their own units. The loss over a distributed output layer needs two
all-reduces of [B] vectors (max; then sum of exponentials and target logit in one call):
cross-entropy is computed exactly as on one process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from netpart.errors import ShapeMismatchError
from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.partition.schedule import HaloSchedule, Instruction
from netpart.runtime.slices import LayerSlice, build_slice, rows
from netpart.runtime.transport import Handle, Transport

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


class _StepState:
    """Everything one step's instructions read and write."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, transport: Transport):
        self.inputs, self.targets, self.transport = inputs, targets, transport
        self.batch = inputs.shape[0]
        self.outs: dict[int, torch.Tensor] = {}  # layer -> owned outputs [U, B]
        self.leaves: dict[int, torch.Tensor] = {}  # layer -> its input buffer (autograd leaf)
        self.grad: dict[int, torch.Tensor] = {}  # layer -> gradient of its owned outputs
        self.back: dict[int, dict[int, torch.Tensor]] = {}  # layer -> owner -> halo gradient
        self.posted: dict[tuple[int, str], list[Handle]] = {}
        self.sent: dict[tuple[int, str], int] = {}
        self.received: dict[tuple[int, str], int] = {}
        self.compute: dict[tuple[int, str], float] = {}
        self.exchange: dict[tuple[int, str], float] = {}
        self.loss = 0.0
        self.accuracy: float | None = None


def _add(book: dict, key, value) -> None:
    book[key] = book.get(key, 0) + value


class ModelWorker:
    """Holds worker `rank`'s slices of every layer and runs its program through a transport."""

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
        self.program: tuple[Instruction, ...] = schedule.instructions(rank)
        self.owned = [schedule.owned[i][rank] for i in range(len(spec.layers))]
        self.slices: list[LayerSlice] = [
            build_slice(spec, i, self.owned[i], graph.layers[i], seed, dtype)
            for i in range(len(spec.layers))
        ]
        # Per layer: what this worker sends (positions in its owned buffer) and receives (units).
        self._owned_t = [torch.from_numpy(u) for u in self.owned]
        self._buffers: dict[tuple[int, str, int, int], torch.Tensor] = {}
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
        self._run = {
            "compute": self._compute,
            "send": self._send,
            "recv": self._recv,
            "wait": self._wait,
            "loss": self._loss,
        }

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
        st = _StepState(inputs, targets, transport)
        for ins in self.program:
            self._run[ins.op](st, ins)
        last = len(self.spec.layers) - 1
        return WorkerResult(
            rank=self.rank,
            loss=st.loss,
            outputs=st.outs[last].detach().T,
            output_units=self.owned[-1],
            grads=self.collect_grads() if collect_grads else [],
            sent=st.sent,
            received=st.received,
            compute_s=st.compute,
            exchange_s=st.exchange,
            accuracy=st.accuracy,
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

    # ---- instructions ----------------------------------------------------------------------
    def _compute(self, st: _StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        if ins.phase == "forward":
            self._forward(st, ins.layer)
        else:
            self._backward(st, ins.layer)
        _add(st.compute, (ins.layer, ins.phase), time.perf_counter() - t0)

    def _forward(self, st: _StepState, layer: int) -> None:
        x = self._input_buffer(st.batch, layer)
        if layer == 0:
            x[: st.inputs[0].numel()] = st.inputs.reshape(st.batch, -1).T.to(self.dtype)
        else:
            x.index_copy_(0, self._owned_t[layer - 1], st.outs[layer - 1].detach())
            for s, units in self.recvs[layer].items():
                x.index_copy_(0, units, self._halo(layer, "forward", s, st.batch))
            x.requires_grad_(True)
            st.leaves[layer] = x
        st.outs[layer] = self.slices[layer](x)

    def _backward(self, st: _StepState, layer: int) -> None:
        out = st.outs[layer]
        if out.requires_grad:  # False for a parameter-free layer 0, or no owned units
            torch.autograd.backward(out, st.grad[layer])
        if layer == 0:
            return
        leaf = st.leaves[layer]
        gx = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        st.grad[layer - 1] = rows(gx, self._owned_t[layer - 1])
        st.back[layer] = {s: rows(gx, units) for s, units in self.recvs[layer].items()}

    def _send(self, st: _StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        if ins.phase == "forward":
            payload = rows(st.outs[ins.layer - 1].detach(), self.sends[ins.layer][ins.peer])
        else:
            payload = st.back[ins.layer][ins.peer]
        self._post(st, ins, st.transport.send, payload, st.sent, t0)

    def _recv(self, st: _StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        buf = self._halo(ins.layer, ins.phase, ins.peer, st.batch)
        self._post(st, ins, st.transport.recv, buf, st.received, t0)

    def _post(self, st: _StepState, ins: Instruction, post, tensor, book, t0: float) -> None:
        """Post one message of (layer, phase); count its bytes, and its time since `t0`."""
        tag = 2 * ins.layer + (ins.phase == "backward")
        key = (ins.layer, ins.phase)
        st.posted.setdefault(key, []).append(post(tag, ins.peer, tensor))
        _add(book, key, tensor.numel() * tensor.element_size())
        _add(st.exchange, key, time.perf_counter() - t0)

    def _wait(self, st: _StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        st.transport.wait(st.posted.pop((ins.layer, ins.phase)))
        if ins.phase == "backward":  # the gradients owed to this worker's units of layer - 1
            grad = st.grad[ins.layer - 1]
            for d, pos in self.sends[ins.layer].items():
                grad.index_add_(0, pos, self._halo(ins.layer, "backward", d, st.batch))
        _add(st.exchange, (ins.layer, ins.phase), time.perf_counter() - t0)

    def _loss(self, st: _StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        st.loss, st.grad[ins.layer], st.accuracy = self._loss_and_grad(
            st.outs[ins.layer], st.targets, st.transport
        )
        st.exchange[(ins.layer + 1, "loss")] = time.perf_counter() - t0

    # ---- buffers ---------------------------------------------------------------------------
    def _input_buffer(self, batch: int, layer: int) -> torch.Tensor:
        """Input buffer [n + 2, B]: row n is zero padding, row n + 1 is -inf padding."""
        n = self.spec.input_shape(layer).size
        x = torch.zeros(n + 2, batch, dtype=self.dtype)
        x[n + 1] = float("-inf")
        return x

    def _halo(self, layer: int, phase: str, peer: int, batch: int) -> torch.Tensor:
        """The receive buffer of one message, sized by the schedule, allocated once.

        Reuse is safe: its contents are copied into the layer's input buffer (forward) or
        added into the gradients (backward) before the next step overwrites them.
        """
        key = (layer, phase, peer, batch)
        buf = self._buffers.get(key)
        if buf is None:
            units = self.recvs[layer] if phase == "forward" else self.sends[layer]
            buf = self._buffers[key] = torch.empty(len(units[peer]), batch, dtype=self.dtype)
        return buf

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
