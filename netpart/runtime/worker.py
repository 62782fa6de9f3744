"""ModelWorker: one model worker, an interpreter of its program from the halo schedule.

The worker holds its slices of every layer and runs `schedule.instructions(rank)` — the
program `HaloSchedule.validate` checked before any process started — one instruction at a
time: compute a layer (or part of one), post a halo send or receive, wait for a phase's
messages, compute the loss. It derives no order of its own, so what runs is what was
validated.

Forward, a layer's input buffer holds the owned units of the layer below (in a layer graph, of
every layer it reads, end to end: its input space) and the halo received from their owners;
backward, the gradient w.r.t. halo inputs goes back to their owners, which add it to the
gradients of their own units (a layer read by several adds theirs up). The loss over a
distributed output layer
(`runtime.loss`) costs one all-gather of a few values per example and equals the reference's.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from netpart.compile.indices import worker_indices
from netpart.compile.program import Instruction, Op, Part, Phase
from netpart.compile.schedule import HaloSchedule
from netpart.models.dropout import DropoutKey, keep_scale
from netpart.models.reference import activation
from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.runtime.batchnorm import BatchNormSlice, collect_statistics
from netpart.runtime.build import build_slice
from netpart.runtime.loss import OutputLoss
from netpart.runtime.rows import RowIndex, rows
from netpart.runtime.slices import LayerSlice
from netpart.runtime.state import Ledger, StepState, WorkerResult, book_key
from netpart.runtime.transport import Handle, Transport

__all__ = ["ModelWorker", "WorkerResult"]

log = logging.getLogger(__name__)


class ModelWorker:
    """Holds worker `rank`'s slices of every layer and runs its program through a transport."""

    def __init__(
        self,
        spec: ModelSpec,
        graph: UnitGraph,
        schedule: HaloSchedule,
        rank: int,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec, self.schedule, self.rank, self.dtype = spec, schedule, rank, dtype
        self.seed = seed  # its initial weights', and a timed step's dropout masks'
        self.program: tuple[Instruction, ...] = schedule.instructions(rank)
        tables = worker_indices(schedule, rank)
        self.owned = list(tables.owned)
        self.slices: list[LayerSlice] = [
            build_slice(spec, i, self.owned[i], graph.layers[i], seed, dtype, tables.first[i])
            for i in range(len(spec.layers))
        ]
        # Producer chains: where the early units go (the next layer's buffer; their place in
        # the early outputs, in units order) and which of them each message sends.
        self._early_t = {i: RowIndex(e) for i, e in tables.early.items()}
        self._late_t = {i: RowIndex(e) for i, e in tables.late.items()}
        self._orders = {  # a part's rows -> their units' order
            (i, part): torch.argsort(self.slices[i].positions[part])
            for i in self._early_t
            for part in ("first", "rest")
        }
        self._feeds = tables.feeds  # the layer above is chained
        self._early_sends = {
            i: {d: RowIndex(u) for d, u in peers.items()} for i, peers in tables.early_sends.items()
        }
        # Per layer: what this worker sends (positions in its owned outputs) and receives
        # (units of the input buffer); contiguous ones move as views.
        self._owned_t = [RowIndex(u) for u in self.owned]
        # A layer graph's input spaces: where each input's units land, and which rows of a
        # message are the gradients owed to which input (`WorkerIndices.into`).
        self._into = [
            [(s, None if u is None else RowIndex(u)) for s, u in layer] for layer in tables.into
        ]
        self._split_sends = {
            i: {d: [(s, RowIndex(r), RowIndex(p)) for s, r, p in parts] for d, parts in m.items()}
            for i, m in tables.split_sends.items()
        }
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.sends = [{d: RowIndex(u) for d, u in peers.items()} for peers in tables.sends]
        self.recvs = [{s: RowIndex(u) for s, u in peers.items()} for peers in tables.recvs]
        self._params = [list(s.parameters()) for s in self.slices]
        self._output_loss = OutputLoss(spec, self.owned[-1], dtype)
        self._run = {
            Op.COMPUTE: self._compute,
            Op.SEND: self._send,
            Op.RECV: self._recv,
            Op.WAIT: self._wait,
            Op.LOSS: self._loss,
        }

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for params in self._params for p in params]

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        transport: Transport,
        *,
        collect_grads: bool = True,
        stop: bool = False,
        accuracy: bool = True,
        dropout: DropoutKey | None = None,
    ) -> WorkerResult:
        """One forward/backward pass of the whole batch; grads accumulate in the slices.

        With `collect_grads` the result carries copies of the gradients keyed for the
        reference module (costly: leave it off for steps whose gradients stay local).
        `stop` travels with the loss's one collective: the result's `stop` is True when any
        worker of the replica asked to stop, so they all stop after the same step. Several
        workers get the batch accuracy for free from that collective; a lone worker computes
        it only with `accuracy`. `dropout`: the step's key, for layers with dropout (None:
        none; `netpart.models.dropout`).
        """
        flag = 1.0 if stop else 0.0
        st = StepState(inputs, targets, transport, flag, want_accuracy=accuracy, dropout=dropout)
        for ins in self.program:
            self._run[ins.op](st, ins)
        last = len(self.spec.layers) - 1
        return WorkerResult(
            rank=self.rank,
            loss=st.loss,
            outputs=st.fwd.outs[last].detach().T,
            output_units=self.owned[-1],
            grads=self.collect_grads() if collect_grads else [],
            statistics=collect_statistics(self.slices) if collect_grads else [],
            **st.book.figures(),
            accuracy=st.accuracy,
            stop=st.stop,
        )

    def evaluate(self, inputs, targets, transport: Transport) -> tuple[float, float | None]:
        """(loss, accuracy) of a batch with no backward pass (held-out data): the forward
        instructions and the loss; every worker of the replica runs the same messages."""
        st = StepState(inputs, targets, transport, 0.0, want_accuracy=True)
        for s in self.slices:  # batch norms use their running statistics
            s.train(False)
        try:
            for ins in self.program:
                if ins.phase == Phase.FORWARD:  # the loss is a forward instruction
                    self._run[ins.op](st, ins)
        finally:
            for s in self.slices:
                s.train(True)
        return st.loss, st.accuracy

    def exchange_only(self, batch: int, transport: Transport) -> float:
        """Run only this program's messages (same peers, sizes and order; the loss's one
        all-gather included) with no compute between them: what the bytes alone cost.
        Returns the wall seconds."""
        t0 = time.perf_counter()
        posted: dict[tuple[int, str], list[Handle]] = {}
        for ins in self.program:
            key = book_key(ins)
            if ins.op == Op.SEND:  # buffers of the message's size stand in for data
                buf = self._stand_in(ins.count, batch)
                posted.setdefault(key, []).append(transport.send(ins.tag, ins.peer, buf))
            elif ins.op == Op.RECV:
                buf = self._halo(ins.layer, ins.phase, ins.peer, batch)
                posted.setdefault(key, []).append(transport.recv(ins.tag, ins.peer, buf))
            elif ins.op == Op.WAIT:
                transport.wait(posted.pop(key))
            elif ins.op == Op.LOSS:
                self._output_loss.exchange_only(batch, transport)
        return time.perf_counter() - t0

    def _stand_in(self, count: int, batch: int) -> torch.Tensor:
        key = ("stand-in", count, batch)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(count, batch, dtype=self.dtype)
        return self._buffers[key]

    def collect_grads(self) -> list[tuple[str, np.ndarray, torch.Tensor]]:
        """(reference parameter name, flat index into it, gradient values) of every slice."""
        return [
            (name, idx, grad.detach().clone())
            for s in self.slices
            for name, idx, grad in s.param_slices()
        ]

    def param_tensors(self) -> list[torch.Tensor]:
        """The worker's parameter values, one tensor per piece, in the layout's piece order
        (its flat vector is these end to end; fetched values are copied into them)."""
        return [t for s in self.slices for t in s.param_tensors()]

    def bind_grads(self, flat: torch.Tensor) -> None:
        """Make backward accumulate straight into `flat` (the pieces' gradients end to end,
        in the order of `param_tensors`). The views of a buffer are cut once and reused."""
        key = ("grads", flat.data_ptr(), flat.numel())
        bound = self._buffers.get(key)
        if bound is None:
            views = iter(flat.split([t.numel() for t in self.param_tensors()]))
            for s in self.slices:
                s.bind_grads([next(views).view_as(t) for t in s.param_tensors()])
            bound = self._buffers[key] = [(p, p.grad) for p in self.parameters()]
            return
        for p, view in bound:
            p.grad = view

    def bind_values(self, flat: torch.Tensor) -> None:
        """Make the parameters views of `flat` (the pieces' values end to end, in the order of
        `param_tensors`): fetched values are used where they landed, not copied. The caller
        keeps `flat` unchanged while it is bound and no autograd graph holds the old values."""
        key = ("values", flat.data_ptr(), flat.numel())
        views = self._buffers.get(key)
        if views is None:
            cut = iter(flat.split([t.numel() for t in self.param_tensors()]))
            views = self._buffers[key] = [
                [next(cut).view_as(t) for t in s.param_tensors()] for s in self.slices
            ]
        for s, mine in zip(self.slices, views, strict=True):
            s.bind_values(mine)

    def flat_grads(self) -> torch.Tensor:
        """The pieces' gradients end to end (zeros where none)."""
        return torch.cat([g.reshape(-1) for s in self.slices for g in s.piece_grads()])

    def zero_grad(self) -> None:
        for params in self._params:
            for p in params:
                p.grad = None

    # ---- instructions ----------------------------------------------------------------------
    def _compute(self, st: StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        if ins.phase == Phase.FORWARD:
            self._forward(st, ins.layer, ins.part)
        else:
            self._backward(st, ins.layer, ins.part)
        Ledger.add(st.book.compute, book_key(ins), time.perf_counter() - t0)

    def _forward(self, st: StepState, layer: int, part: str) -> None:
        sl, clock = self.slices[layer], time.perf_counter
        if isinstance(sl, BatchNormSlice):
            sl.transport = st.transport
        if part in (Part.EARLY, Part.LATE):
            return self._forward_chain(st, layer, part)
        alone = not isinstance(sl, BatchNormSlice) or st.transport.size == 1
        if sl.plane and alone and part in (Part.ALL, Part.JOINED):
            return self._forward_plane(st, layer, part)
        t0 = clock()
        if part == Part.JOINED:
            x = self._joined_input(st, layer)
        elif part != Part.BOUNDARY:
            x = self._fill_input(st, layer, halo=part == Part.ALL)
        else:
            x = st.fwd.leaves[layer]
            with torch.no_grad():  # the halo, into the buffer the interior part already read
                self._fill_halo(st, layer, self._input_buffer(st.batch, layer))
        t1 = clock()
        if part in (Part.ALL, Part.JOINED):
            out = sl.forward(x)  # not through nn.Module's __call__: no hooks here
            st.fwd.outs[layer] = self._dropped(st, layer, out)
        elif part == Part.INTERIOR:
            st.fwd.pieces[layer] = sl.compute(x, "first")
        else:
            out = sl.place(st.fwd.pieces.pop(layer) + sl.compute(x, "rest"), True, x)
            st.fwd.outs[layer] = self._dropped(st, layer, out)
        st.book.breakdown["fill"] += t1 - t0
        st.book.breakdown["slice"] += clock() - t1

    def _forward_plane(self, st: StepState, layer: int, part: str) -> None:
        """A whole conv, pool or LCN layer on planes [B, C, H, W] (`LayerSlice.plane`): its
        input the batch itself, the planes of a whole layer below computed so (views, no
        copies), or the input buffer (the layer below's owned units and the halo) seen as
        planes; its outputs kept as planes, seen as [units, B] by whatever reads them."""
        sl, clock = self.slices[layer], time.perf_counter
        t0 = clock()
        batch, src = st.batch, self.spec.input_shape(layer)
        planes = (batch, src.channels, src.height, src.width)
        if layer == 0:
            x = st.inputs.reshape(planes).to(self.dtype)
        elif self.spec.layers[layer].inputs is not None:  # a layer graph's: its inputs' planes
            x = self._input_planes(st, layer, part)
        elif part == Part.JOINED and len(self.owned[layer - 1]) == src.size:
            x = self._planes_of(st, layer - 1, planes)  # every unit below, in order
        else:
            buf = self._joined_input(st, layer) if part == Part.JOINED else None
            buf = self._fill_input(st, layer, halo=True) if buf is None else buf
            x = buf[: src.size].T.reshape(planes)
        t1 = clock()
        y = sl.forward_plane(x)
        out = y.reshape(batch, -1).T  # [units, B], a view of the planes
        st.fwd.outs[layer] = self._dropped(st, layer, out)  # keeps the planes' layout
        if st.fwd.outs[layer] is out:  # no dropout: the planes themselves are the outputs
            st.fwd.planes[layer] = y
        st.book.breakdown["fill"] += t1 - t0
        st.book.breakdown["slice"] += clock() - t1

    def _input_planes(self, st: StepState, layer: int, part: str):
        """A layer graph's layer's input as planes [B, C, H, W]: each input layer's outputs
        (joined: this worker computed all of them) or its part of the input buffer (the owned
        units and the halo); a merge gets the list of them, in its inputs' order."""
        batch = st.batch
        if part != Part.JOINED:
            buf = self._fill_input(st, layer, halo=True)
        found = {}
        for source in self.spec.input_layers(layer):
            shape = self.spec.input.shape if source < 0 else self.spec.shapes[source]
            planes = (batch, shape.channels, shape.height, shape.width)
            if source < 0:
                found[source] = st.inputs.reshape(planes).to(self.dtype)
            elif part == Part.JOINED:
                found[source] = self._planes_of(st, source, planes)
            else:
                at = self.spec.input_offset(layer, source)
                found[source] = buf[at : at + shape.size].T.reshape(planes)
        xs = [found[s] for s in self.spec.sources(layer)]
        return xs if self.spec.layers[layer].kind in ("add", "concat") else xs[0]

    def _planes_of(self, st: StepState, layer: int, planes: tuple) -> torch.Tensor:
        """The outputs of `layer` (all of it computed here) as planes `planes`: the planes it
        was computed as, else its [units, B] outputs seen as planes."""
        found = st.fwd.planes.get(layer)
        return found if found is not None else st.fwd.outs[layer].T.reshape(planes)

    def _dropped(
        self, st: StepState, layer: int, out: torch.Tensor, places: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out` ([rows, B]: the slice's units in units order, or those at `places` of them)
        times the step's dropout mask of `layer`, if it has one."""
        p = self.spec.layers[layer].dropout
        if not p or st.dropout is None:
            return out
        units = torch.from_numpy(self.slices[layer].units)
        units = units if places is None else units[places]
        return out * keep_scale(p, layer, units, out.shape[1], st.dropout, out.dtype)

    def _forward_chain(self, st: StepState, layer: int, part: str) -> None:
        """A producer chain's early units (reading the early units below, or all of the
        layer below when it is complete), or its late units (the rest of the layer below
        written into the same buffer first). Each part keeps its own activated outputs as
        the root of its backward; the layer's outputs in units order are assembled once the
        late part is done."""
        sl, clock = self.slices[layer], time.perf_counter
        t0 = clock()
        batch = st.batch
        below = layer - 1 in self._feeds  # the layer below is computed in parts too
        if part == Part.EARLY:
            if not below:
                x = self._fill_input(st, layer, halo=False)
            else:  # the early units below, into a buffer read as a fresh leaf
                buf = self._input_buffer(batch, layer)
                self._early_t[layer - 1].put_(buf, st.fwd.early_out[layer - 1])
                x = st.fwd.leaves[layer] = buf.detach().requires_grad_(True)
            st.fwd.chain_inputs[layer] = x
        else:
            x = st.fwd.chain_inputs.pop(layer)
            if below:  # the late units below, into the same buffer
                with torch.no_grad():
                    buf = self._input_buffer(batch, layer)
                    self._late_t[layer - 1].put_(buf, st.fwd.late_out.pop(layer - 1))
        t1 = clock()
        first = part == Part.EARLY
        pieces = sl.compute(x, "first" if first else "rest")
        out = activation(sl.layer, torch.cat([p.reshape(-1, batch) for p in pieces]))
        out = self._dropped(st, layer, out, sl.positions["first" if first else "rest"])
        st.fwd.parts[(layer, part)] = out
        if first:
            st.fwd.early_out[layer] = rows(out.detach(), self._orders[(layer, "first")])
        elif layer in self._feeds:
            st.fwd.late_out[layer] = rows(out.detach(), self._orders[(layer, "rest")])
        else:  # the chain's top: its outputs in units order, for the layer above
            early = st.fwd.parts[(layer, Part.EARLY)].detach()
            st.fwd.outs[layer] = rows(torch.cat([early, out.detach()]), sl.order(True))
        st.book.breakdown["fill"] += t1 - t0
        st.book.breakdown["slice"] += clock() - t1

    def _fill_input(self, st: StepState, layer: int, halo: bool) -> torch.Tensor:
        """The layer's input buffer (reused across steps) with the owned units of the layer
        below (and, with `halo`, the halo): a fresh autograd leaf over it. A dense first
        layer reads the batch itself, transposed (a view: no copy)."""
        if layer == 0:
            flat = st.inputs.reshape(st.batch, -1).T.to(self.dtype)
            if self.spec.layers[0].kind == "dense":
                return flat
            buf = self._input_buffer(st.batch, layer)
            buf[: flat.shape[0]] = flat
            return buf
        buf = self._input_buffer(st.batch, layer)
        for source, into in self._into[layer]:
            if source >= 0:
                into.put_(buf, st.fwd.outs[source].detach())
            else:  # the network's input, which every worker holds
                at = self.spec.input_offset(layer, -1)
                flat = st.inputs.reshape(st.batch, -1).T
                buf[at : at + flat.shape[0]] = flat
        if halo:
            self._fill_halo(st, layer, buf)
        x = buf.detach().requires_grad_(True)
        st.fwd.leaves[layer] = x
        return x

    def _joined_input(self, st: StepState, layer: int) -> torch.Tensor:
        """The layer's input as a function of the layer below's outputs (one autograd graph):
        no leaf, no copy into a buffer when this worker owns the whole layer below, else the
        owned rows written in place into a fresh alias of the reused buffer (no clone)."""
        (source,) = self.spec.input_layers(layer)  # one: a merge joins on planes
        if source < 0:  # a layer graph's layer reading the network's input
            prev = st.inputs.reshape(st.batch, -1).T.to(self.dtype)
        else:
            prev = st.fwd.outs[source]
        buf = self._input_buffer(st.batch, layer)
        n = buf.shape[0] - 2
        if source < 0 or len(self.owned[source]) == n:  # every unit, in order
            if self.spec.layers[layer].kind == "dense":  # reads no padding rows
                return prev
            return torch.cat([prev, buf[n:]])
        return buf.detach().index_copy_(0, self._owned_t[source].index, prev)

    def _fill_halo(self, st: StepState, layer: int, buf: torch.Tensor) -> None:
        """Copy received halo into the input buffer (contiguous ones were received there)."""
        for s, units in self.recvs[layer].items():
            if units.span is None:
                units.put_(buf, self._halo(layer, Phase.FORWARD, s, st.batch))

    def _backward(self, st: StepState, layer: int, part: str) -> None:
        clock = time.perf_counter
        t0 = clock()
        if part in (Part.LATE, Part.EARLY):
            return self._backward_chain(st, layer, part)
        if part == Part.THROUGH:  # joined to the layer below: its backward computes this one too
            root = st.bwd.pending or (st.fwd.outs[layer], st.bwd.grad.get(layer), [])
            st.bwd.pending = (root[0], root[1], root[2] + self._params[layer])
            self._release(st, layer)
            return
        if part == Part.WEIGHTS:
            out, grad, params = st.bwd.roots.pop(layer)
            if out.requires_grad and params:
                torch.autograd.backward(out, grad, inputs=params)
            st.book.breakdown["slice"] += clock() - t0
            return
        out, grad, params = st.bwd.pending or (st.fwd.outs[layer], st.bwd.grad.get(layer), [])
        params = params + self._params[layer]
        st.bwd.pending = None
        leaf = st.fwd.leaves.get(layer)
        live = out.requires_grad  # False for a parameter-free start, or no owned units
        gx = None
        if part == Part.INPUT and live:
            (gx,) = torch.autograd.grad(out, leaf, grad, retain_graph=True)
            st.bwd.roots[layer] = (out, grad, params)
        elif live:
            torch.autograd.backward(out, grad)
            gx = leaf.grad if leaf is not None else None
        t1 = clock()
        st.book.breakdown["slice"] += t1 - t0
        self.slices[layer].settle()  # a batch norm's collective, if its backward did not run it
        if layer == 0:
            return
        self._release(st, layer)
        gx = gx if gx is not None else torch.zeros_like(leaf)
        for source, into in self._into[layer]:
            if source < 0:
                continue
            mine = into.take(gx)
            had = st.bwd.grad.get(source)  # a layer read by several: their gradients add up
            st.bwd.grad[source] = mine if had is None else had + mine
        st.bwd.back[layer] = {s: units.take(gx) for s, units in self.recvs[layer].items()}
        st.book.breakdown["fill"] += clock() - t1

    def _release(self, st: StepState, layer: int) -> None:
        """Let go of `layer`'s forward tensors once its backward has begun (autograd frees
        what it saved as it goes): held to the step's end, every step's memory peaked and the
        allocator faulted its pages back in. The last layer's outputs are the result."""
        if layer < len(self.spec.layers) - 1:
            st.fwd.outs.pop(layer, None)
        st.fwd.planes.pop(layer, None)

    def _backward_chain(self, st: StepState, layer: int, part: str) -> None:
        """One part of a producer chain's layer backward, from that part's own outputs: the
        late units' gradients are all this worker's (no peer reads them), the early units'
        are complete once the peers' have been added. The gradient of the layer below is
        taken again after each part (the second adds to the first)."""
        clock = time.perf_counter
        t0 = clock()
        sl = self.slices[layer]
        grad = rows(st.bwd.grad[layer], sl.positions["first" if part == Part.EARLY else "rest"])
        out = st.fwd.parts.pop((layer, part))
        if out.requires_grad:  # not a parameter-free first layer
            torch.autograd.backward(out, grad)
        t1 = clock()
        st.book.breakdown["slice"] += t1 - t0
        if layer > 0:
            st.bwd.grad[layer - 1] = self._owned_t[layer - 1].take(st.fwd.leaves[layer].grad)
            st.bwd.back[layer] = {}
        st.book.breakdown["fill"] += clock() - t1

    def _send(self, st: StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        below = ins.layer - 1
        if ins.phase == Phase.FORWARD and below not in st.fwd.outs:  # sent before the late units
            payload = self._early_sends[ins.layer][ins.peer].take(st.fwd.early_out[below])
        elif ins.phase == Phase.FORWARD:
            payload = self.sends[ins.layer][ins.peer].take(self._owned_inputs(st, ins.layer))
        else:
            payload = st.bwd.back[ins.layer][ins.peer]
        st.book.breakdown["fill"] += time.perf_counter() - t0
        self._post(st, ins, st.transport.send, payload, st.book.sent)

    def _recv(self, st: StepState, ins: Instruction) -> None:
        buf = None
        if ins.phase == Phase.FORWARD:  # a contiguous halo lands in the input buffer itself
            buf = self.recvs[ins.layer][ins.peer].view_in(self._input_buffer(st.batch, ins.layer))
        if buf is None:
            buf = self._halo(ins.layer, ins.phase, ins.peer, st.batch)
        self._post(st, ins, st.transport.recv, buf, st.book.received)

    def _post(self, st: StepState, ins: Instruction, post, tensor, book) -> None:
        """Post one message of (layer, phase); count its bytes and the time posting took."""
        t0 = time.perf_counter()
        key = book_key(ins)
        st.book.first_post.setdefault(key, t0)
        st.posted.setdefault(key, []).append(post(ins.tag, ins.peer, tensor))
        Ledger.add(book, key, tensor.numel() * tensor.element_size())
        spent = time.perf_counter() - t0
        Ledger.add(st.book.exchange, key, spent)
        st.book.breakdown["post"] += spent

    def _wait(self, st: StepState, ins: Instruction) -> None:
        key = book_key(ins)
        t0 = time.perf_counter()
        st.transport.wait(st.posted.pop(key))
        t1 = time.perf_counter()
        if ins.phase == Phase.BACKWARD and ins.layer in self._split_sends:
            for d, parts in self._split_sends[ins.layer].items():
                halo = self._halo(ins.layer, Phase.BACKWARD, d, st.batch)
                for source, rows_of, pos in parts:
                    pos.add_(st.bwd.grad[source], rows_of.take(halo))
        elif ins.phase == Phase.BACKWARD:  # the gradients owed to its units of layer - 1
            grad = st.bwd.grad[ins.layer - 1]
            for d, pos in self.sends[ins.layer].items():
                pos.add_(grad, self._halo(ins.layer, Phase.BACKWARD, d, st.batch))
        st.book.breakdown["wait"] += t1 - t0
        st.book.breakdown["fill"] += time.perf_counter() - t1
        Ledger.add(st.book.exchange, key, t1 - t0)
        st.book.hidden[key] = max(0.0, t1 - st.book.first_post[key] - st.book.exchange[key])

    def _loss(self, st: StepState, ins: Instruction) -> None:
        t0 = time.perf_counter()
        out = st.fwd.outs[ins.layer]
        if st.transport.size == 1:  # the loss joins the graph: one backward call from it
            root, res = self._output_loss.alone(out, st.targets, st.flag, st.want_accuracy)
            st.bwd.pending = (root, None, [])
        else:
            grad, res = self._output_loss.shared(out, st.targets, st.transport, st.flag)
            st.bwd.grad[ins.layer] = grad
        st.loss, st.accuracy, st.stop = res.loss, res.accuracy, res.stop
        spent = time.perf_counter() - t0
        if st.transport.size > 1:  # a lone worker's loss is compute: it exchanges nothing
            st.book.exchange[(ins.layer + 1, "loss")] = spent
        st.book.breakdown["loss"] += spent

    def _owned_inputs(self, st: StepState, layer: int) -> torch.Tensor:
        """This worker's units of `layer`'s input space, end to end ([rows, B], detached):
        what its messages of the layer take their rows from."""
        outs = [st.fwd.outs[s].detach() for s in self.spec.input_layers(layer) if s >= 0]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # ---- buffers ---------------------------------------------------------------------------
    def _input_buffer(self, batch: int, layer: int) -> torch.Tensor:
        """Layer `layer`'s input buffer [n + 2, B], allocated once per batch size: row n is
        zero padding, row n + 1 is -inf padding; other rows are rewritten every step (rows
        this worker neither owns nor receives are never read)."""
        key = ("input", layer, batch)
        buf = self._buffers.get(key)
        if buf is None:
            n = self.spec.input_size(layer)
            buf = self._buffers[key] = torch.zeros(n + 2, batch, dtype=self.dtype)
            buf[n + 1] = float("-inf")
        return buf

    def _halo(self, layer: int, phase: str, peer: int, batch: int) -> torch.Tensor:
        """The receive buffer of one message, sized by the schedule, allocated once.

        Reuse is safe: its contents are copied into the layer's input buffer (forward) or
        added into the gradients (backward) before the next step overwrites them.
        """
        key = (layer, phase, peer, batch)
        buf = self._buffers.get(key)
        if buf is None:
            units = self.recvs[layer] if phase == Phase.FORWARD else self.sends[layer]
            buf = self._buffers[key] = torch.empty(len(units[peer]), batch, dtype=self.dtype)
        return buf
