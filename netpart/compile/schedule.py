"""HaloSchedule: who owns which units, who sends whom what, and each worker's program.

Units of layer l are numbered by their flat index in the layer's (C, H, W) output. A layer's
*input space* is the outputs of the layers it reads end to end (`ModelSpec.input_layers`; in
a chain, the layer below). For each layer l >= 1 the schedule lists, for every ordered pair of
workers (s, d), the sorted units of l's input space that s owns and d reads: in the forward
pass s sends their activations to d, in the backward pass d sends their gradients back to s.
Each list is one message per phase, so every send has exactly one matching receive of the
same length. The network's input is data every worker holds: it is never sent.

`instructions(w)` is worker w's *program*: the exact sequence of compute steps, message posts
and waits the runtime's worker interprets (it derives nothing itself). All messages of a
(layer, phase) are posted together, non-blocking, then waited for, so no order of peers can
deadlock. `validate` checks, before any process starts, that messages pair up with equal
lengths, that units are owned by their sender, that every program computes each layer once in
an order its data allows, and (with the plan) that volumes equal the plan's figures.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from netpart.compile.chains import producer_chains
from netpart.compile.program import Instruction, check_program
from netpart.cost.overlap import SPLIT_MIN_FLOPS
from netpart.errors import ScheduleError, ShapeMismatchError
from netpart.models.spec import BYTES_PER_VALUE, ModelSpec
from netpart.partition.graph import UnitGraph, build_unit_graph, owned_units
from netpart.partition.plans import PartitionPlan
from netpart.partition.reads import read_window
from netpart.partition.volume import needed_units

__all__ = [
    "NO_SPLITS",
    "SPLIT_MIN_FLOPS",
    "HaloSchedule",
    "build_schedule",
    "interior_units",
    "plan_schedule",
]


@dataclass(frozen=True, eq=False)
class HaloSchedule:
    """owned[l][w]: sorted units of layer l owned by w. sends[l][(s, d)]: units of l-1, s -> d.

    kinds[l]: layer l's kind; interior[l][w]: the owned units of layer l whose reads are all
    owned by w (they can be computed while w's halo travels). With `overlap` the programs
    compute those first, and send input gradients before computing weight gradients.
    Without kinds (a bare schedule) programs never split a layer.
    """

    workers: int
    owned: tuple[tuple[np.ndarray, ...], ...]
    sends: tuple[dict[tuple[int, int], np.ndarray], ...]
    kinds: tuple[str, ...] = ()
    interior: tuple[tuple[np.ndarray, ...], ...] = ()
    overlap: bool = False
    flops: np.ndarray | None = None  # [layers, workers] forward+backward FLOPs per example
    split_min_flops: float = 0.0
    split: tuple[bool, ...] = ()  # per layer: whether its split pays (the plan's choice; () all)
    early: tuple[tuple[np.ndarray, ...], ...] = ()  # producer chains' early units
    chains: tuple[
        tuple[tuple[int, int], ...], ...
    ] = ()  # per worker: (a, b), netpart.compile.chains
    # per layer, the layers its input space holds (-1: the network's input; () : a chain);
    # `graph`: a layer graph, or a chain with batch norm, which splits no layer and joins
    # layers only for a worker holding every layer
    inputs: tuple[tuple[int, ...], ...] = ()
    graph: bool = False
    input_units: int = 0  # the network input's units (a layer graph's input spaces hold it)

    def input_layers(self, layer: int) -> tuple[int, ...]:
        """The layers (>= 0) whose units layer `layer`'s input space holds."""
        if not self.inputs:
            return (layer - 1,) if layer else ()
        return tuple(s for s in self.inputs[layer] if s >= 0)

    def joined(self, worker: int, layer: int) -> bool:
        """Whether `worker` owns every unit of the layer below `layer` and exchanges nothing
        for `layer` in either direction: then `layer` reads the layer below inside one
        autograd graph (no leaf, no copy), and its backward flows on without a call of its
        own. Every layer of a lone worker of a chain is joined (a layer graph joins none)."""
        if not self.overlap or layer == 0 or any(worker in pair for pair in self.sends[layer]):
            return False
        if self.graph:  # only a worker holding every layer: one autograd graph
            return all(len(units[worker]) == sum(len(u) for u in units) for units in self.owned)
        below = self.owned[layer - 1]
        return len(below[worker]) == sum(len(u) for u in below)

    def split_forward(self, worker: int, layer: int) -> bool:
        """Whether `worker` computes layer `layer` in two parts: interior units while the
        halo travels, the boundary units once it is in (both parts must be non-empty)."""
        if not self.overlap or not self.kinds or self.kinds[layer] == "dense" or layer == 0:
            return False
        if self.graph:
            return False
        if not any(d == worker for (_, d) in self.sends[layer]) or not self._worth(worker, layer):
            return False
        inner = len(self.interior[layer][worker])
        return 0 < inner < len(self.owned[layer][worker])

    def split_backward(self, worker: int, layer: int) -> bool:
        """Whether `worker` sends layer `layer`'s input gradients before its weight gradients
        (only a layer with weights that owes gradients to other workers)."""
        if not self.overlap or not self.kinds or layer == 0 or self.graph:
            return False
        owes = any(d == worker for (_, d) in self.sends[layer])
        return (
            owes and self.kinds[layer] in ("local", "conv", "dense") and self._worth(worker, layer)
        )

    def _worth(self, worker: int, layer: int) -> bool:
        """A split costs extra calls: only a layer the plan chose to split, with this much work
        per example, pays (`netpart.cost.overlap`)."""
        if self.split and not self.split[layer]:
            return False
        return self.flops is None or self.flops[layer, worker] >= self.split_min_flops

    def messages(self, worker: int, layer: int, phase: str) -> list[Instruction]:
        """This worker's receives, then sends, of one (layer, phase), in peer order: a
        receive posted first is ready when the peer's data arrives (gloo otherwise waits for
        the receiver's notice behind the bulk data queued on the link; docs/runtime.md)."""
        out, ins = [], []
        for (s, d), units in sorted(self.sends[layer].items()):
            src, dst = (s, d) if phase == "forward" else (d, s)
            if src == worker:
                out.append(Instruction("send", layer, phase, dst, len(units)))
            if dst == worker:
                ins.append(Instruction("recv", layer, phase, src, len(units)))
        return ins + out

    def instructions(self, worker: int) -> tuple[Instruction, ...]:
        """Worker `worker`'s program: forward layer by layer (post the halo; compute the
        interior; wait; compute the rest), the loss, then backward in reverse (the input
        gradients; post them; the weight gradients; wait). A producer chain a..b computes its
        early units, posts layer b + 1's messages, then its late units; backward, its late
        units before the wait for layer b + 1's gradients, its early units after."""
        starts = dict(self.chains[worker]) if self.chains and self.overlap else {}
        tops = {b + 1: (a, b) for a, b in starts.items()}
        prog = [] if 0 in starts else [Instruction("compute", 0)]
        posted: set[int] = set()
        layer = 0 if 0 in starts else 1
        while layer < len(self.sends):
            if layer in starts:
                a, b = layer, starts[layer]
                prog += self._forward_layer(worker, a, posted, part="early")
                prog += [Instruction("compute", k, part="early") for k in range(a + 1, b + 1)]
                prog += self.messages(worker, b + 1, "forward")
                posted.add(b + 1)
                prog += [Instruction("compute", k, part="late") for k in range(a, b + 1)]
                layer = b + 1
                continue
            prog += self._forward_layer(worker, layer, posted)
            layer += 1
        prog.append(Instruction("loss", len(self.sends) - 1))
        chained = {k for a, b in starts.items() for k in range(a, b + 1)}
        layer = len(self.sends) - 1
        while layer > 0:
            below = tops.get(layer)  # the chain whose early units this layer's halo carries
            late = [
                Instruction("compute", k, "backward", part="late")
                for k in (range(below[1], below[0] - 1, -1) if below else ())
            ]
            early = [dataclasses.replace(i, part="early") for i in late]
            if layer in chained:  # its parts went with its chain: here only its messages
                msgs = self.messages(worker, layer, "backward")
                wait = [Instruction("wait", layer, "backward")] if msgs else []
                prog += [*msgs, *late, *wait, *early]
            else:
                prog += self._backward_layer(worker, layer, late, early)
            layer = below[0] if below else layer - 1
        if 0 not in chained:
            prog.append(Instruction("compute", 0, "backward"))
        return tuple(prog)

    def _forward_layer(self, worker: int, layer: int, posted: set, part: str = "") -> list:
        """One layer's forward instructions (its messages unless `posted` already); with
        `part` ("early"), only its messages and wait, then that part."""
        msgs = self.messages(worker, layer, "forward") if layer else []
        wait = [Instruction("wait", layer)] if msgs else []
        msgs = [] if layer in posted else msgs
        if part:
            return [*msgs, *wait, Instruction("compute", layer, part=part)]
        if self.joined(worker, layer):
            return [Instruction("compute", layer, part="joined")]
        if self.split_forward(worker, layer):
            inner = Instruction("compute", layer, part="interior")
            return [*msgs, inner, *wait, Instruction("compute", layer, part="boundary")]
        return [*msgs, *wait, Instruction("compute", layer)]

    def _backward_layer(self, worker: int, layer: int, before: list, after: list) -> list:
        """One layer's backward instructions; `before` run while its messages travel (before
        the wait), `after` once they are in."""
        msgs = self.messages(worker, layer, "backward")
        wait = [Instruction("wait", layer, "backward")] if msgs else []
        if self.joined(worker, layer):
            return [Instruction("compute", layer, "backward", part="through"), *before, *after]
        if self.split_backward(worker, layer):
            grads = Instruction("compute", layer, "backward", part="input")
            weights = Instruction("compute", layer, "backward", part="weights")
            return [grads, *msgs, weights, *before, *wait, *after]
        return [Instruction("compute", layer, "backward"), *msgs, *before, *wait, *after]

    def table(self, worker: int) -> str:
        """The program of `worker` as a text table (for `netpart check --show-schedule`)."""
        rows = [f"{'#':>4}  {'op':<8} {'layer':>5}  {'phase':<9} {'peer':>4} {'units':>8}  part"]
        for k, ins in enumerate(self.instructions(worker)):
            peer = str(ins.peer) if ins.peer >= 0 else ""
            count = f"{ins.count:,}" if ins.op in ("send", "recv") else ""
            part = ins.part if ins.op == "compute" else ""
            row = f"{k:>4}  {ins.op:<8} {ins.layer:>5}  {ins.phase:<9} {peer:>4} {count:>8}  {part}"
            rows.append(row.rstrip())
        return "\n".join(rows)

    def validate(self, plan: PartitionPlan | None = None) -> None:
        """Raise ScheduleError unless every send pairs with one receive of the same length,
        units are owned by their sender and not by their receiver, every worker's program is
        well ordered (`check_program`), and (with `plan`) the per-layer and per-worker volumes
        equal the figures recorded in the plan."""
        for layer in range(1, len(self.sends)):
            owner = self._input_owner(layer)
            for (s, d), units in self.sends[layer].items():
                if s == d or not (0 <= s < self.workers and 0 <= d < self.workers):
                    raise ScheduleError(f"layer {layer}: message {s} -> {d} has no valid peer")
                if np.any(owner[units] != s):
                    raise ScheduleError(
                        f"layer {layer}: worker {s} sends {d} units it does not own"
                    )
        for w, chains in enumerate(self.chains):
            for _, b in chains:
                out = [u for (s, _), u in self.sends[b + 1].items() if s == w]
                if not np.isin(np.concatenate(out), self.early[b][w]).all():
                    raise ScheduleError(f"worker {w}: layer {b} sends units it computes late")
        sent: dict[tuple, int] = {}
        received: dict[tuple, int] = {}
        for w in range(self.workers):
            program = self.instructions(w)
            sources = tuple(self.input_layers(i) for i in range(len(self.sends)))
            check_program(program, len(self.sends), w, sources=sources)
            for ins in program:
                if ins.op not in ("send", "recv"):
                    continue
                src, dst = (w, ins.peer) if ins.op == "send" else (ins.peer, w)
                book = sent if ins.op == "send" else received
                key = (ins.layer, ins.phase, src, dst)
                if key in book:
                    raise ScheduleError(f"layer {key[0]} {key[1]}: two {ins.op}s {src} -> {dst}")
                book[key] = ins.count
        for key in sent.keys() ^ received.keys():
            side = "receive" if key in sent else "send"
            raise ScheduleError(f"layer {key[0]} {key[1]}: {key[2]} -> {key[3]} has no {side}")
        for key, count in sent.items():
            if received[key] != count:
                raise ShapeMismatchError(
                    f"layer {key[0]} {key[1]}: {key[2]} -> {key[3]} sends {count} units, "
                    f"the receiver expects {received[key]}"
                )
        if plan is not None:
            self._check_against(plan)

    def _check_against(self, plan: PartitionPlan) -> None:
        t = self.traffic()
        if plan.workers != self.workers or len(plan.layers) != len(self.sends):
            raise ShapeMismatchError(
                f"schedule has {self.workers} workers and {len(self.sends)} layers, the plan "
                f"{plan.workers} and {len(plan.layers)}"
            )
        for layer, figures in enumerate(plan.layers):
            if int(t[layer].sum()) != figures.volume:
                raise ShapeMismatchError(
                    f"layer {layer}: the node map sends {int(t[layer].sum())} units per example, "
                    f"plan.json says {figures.volume}; the plan files do not belong together"
                )
        total = t.sum(axis=0) * BYTES_PER_VALUE
        for w, figures in enumerate(plan.per_worker):
            if (total[:, w].sum(), total[w].sum()) != (
                figures.halo_in_bytes,
                figures.halo_out_bytes,
            ):
                raise ShapeMismatchError(
                    f"worker {w}: halo in/out differs from plan.json; the plan files do not "
                    "belong together"
                )

    def _input_owner(self, layer: int) -> np.ndarray:
        """The owner of every unit of `layer`'s input space (-1: the network's input)."""
        if not self.inputs:
            return _owner_of_units(self.owned[layer - 1])
        parts = [
            _owner_of_units(self.owned[s]) if s >= 0 else np.full(self.input_units, -1)
            for s in self.inputs[layer]
        ]
        return np.concatenate(parts)

    def traffic(self) -> np.ndarray:
        """[L, P, P] units per example, as `netpart.partition.volume.layer_traffic` counts them."""
        t = np.zeros((len(self.sends), self.workers, self.workers), dtype=np.int64)
        for layer, msgs in enumerate(self.sends):
            for (s, d), units in msgs.items():
                t[layer, s, d] = len(units)
        return t


def _owner_of_units(owned: tuple[np.ndarray, ...]) -> np.ndarray:
    n = sum(len(o) for o in owned)
    owner = np.full(n, -1, dtype=np.int64)
    for w, units in enumerate(owned):
        owner[units] = w
    return owner


NO_SPLITS = math.inf  # split_min_flops that splits nothing (workers on one host, loopback)


def build_schedule(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    *,
    overlap: bool = True,
    split_min_flops: float = SPLIT_MIN_FLOPS,
    split: tuple[bool, ...] = (),
) -> HaloSchedule:
    """The halo schedule of an assignment (pure; vectorised per layer). With `overlap`, the
    programs hide halo exchange behind the interior units and the weight gradients of every
    layer in `split` (all when empty) whose work on a worker reaches `split_min_flops` per
    example, and join layers that exchange nothing to the layer below."""
    spec = graph.spec
    owned = owned_units(graph, node_map, workers)
    sends: list[dict[tuple[int, int], np.ndarray]] = [{}]
    for index in range(1, len(graph.layers)):
        sends.append(_layer_sends(graph, index, owned, node_map, workers))
    kinds = tuple(layer.kind for layer in spec.layers)
    plain = spec.hides_halo
    interior = tuple(
        tuple(
            interior_units(graph, owned, index, w) if plain else owned[index][w][:0]
            for w in range(workers)
        )
        for index in range(len(graph.layers))
    )
    flops = np.zeros((len(graph.layers), workers))
    np.add.at(flops, (graph.layer_of, node_map), graph.flops)
    early, chains = (), ()
    if overlap and plain:
        early, chains = producer_chains(spec, owned, tuple(sends), flops, split_min_flops, split)
    inputs = () if spec.is_chain else tuple(spec.input_layers(i) for i in range(len(kinds)))
    return HaloSchedule(
        workers,
        owned,
        tuple(sends),
        kinds,
        interior,
        overlap,
        flops,
        split_min_flops,
        split,
        early,
        chains,
        inputs,
        graph=not plain,
        input_units=spec.input.shape.size,
    )


def _layer_sends(
    graph: UnitGraph, index: int, owned: tuple, node_map: np.ndarray, workers: int
) -> dict[tuple[int, int], np.ndarray]:
    """The halo of layer `index`'s input: (sender, receiver) -> the units of the layer's
    input space (`ModelSpec.input_layers`) the receiver reads from the sender's parts of the
    layers it reads (sorted)."""
    spec = graph.spec
    n = spec.input_size(index)
    owner = np.full(n, -1, dtype=np.int64)  # -1: the network's input, held by every worker
    dense = spec.layers[index].kind == "dense"
    if dense:  # a worker holding any of its neurons reads all of its input (no copy per worker)
        readers = np.bincount(node_map[graph.layers[index].ids], minlength=workers) > 0
        needed = np.broadcast_to(readers[:, None], (workers, n))
    elif spec.sources(index) == spec.input_layers(index) == (index - 1,):  # a chain's layer
        needed = needed_units(graph, index, node_map, workers)
    else:
        needed = np.zeros((workers, n), dtype=bool)
        for slot, source in enumerate(spec.sources(index)):
            if source >= 0:
                at, size = spec.input_offset(index, source), graph.layers[source].shape.size
                needed[:, at : at + size] |= needed_units(graph, index, node_map, workers, slot)
    for source in (s for s in spec.input_layers(index) if s >= 0):
        at = spec.input_offset(index, source)
        for w in range(workers):
            owner[at + owned[source][w]] = w
    msgs: dict[tuple[int, int], np.ndarray] = {}
    for d in range(workers):
        units = np.nonzero(needed[d] & (owner != d) & (owner >= 0))[0]
        if len(units) == 0:
            continue
        src = owner[units]
        order = np.argsort(src, kind="stable")
        cuts = np.searchsorted(src[order], np.arange(workers + 1))
        for s in np.nonzero(np.diff(cuts))[0]:
            msgs[(int(s), d)] = units[order[cuts[s] : cuts[s + 1]]]
    return msgs


def interior_units(graph: UnitGraph, owned: tuple, index: int, worker: int) -> np.ndarray:
    """The units of layer `index` owned by `worker` that read only units it owns (sorted).

    A unit's window of the input is a rectangle (one channel for a pool, all channels
    otherwise): it is interior when the rectangle holds no unit another worker owns,
    counted with a summed-area table over the input plane. Dense layers read everything:
    interior only when the worker owns the whole input.
    """
    mine = owned[index][worker]
    spec = graph.spec
    if index == 0:
        return mine
    src = spec.input_shape(index)
    foreign = np.ones(src.size, dtype=bool)
    foreign[owned[index - 1][worker]] = False
    if not spec.layers[index].is_spatial:
        return mine if not foreign.any() else mine[:0]
    planes = foreign.reshape(src.channels, src.height, src.width)
    pool = spec.layers[index].kind == "pool"
    planes = planes if pool else planes.any(axis=0, keepdims=True)
    table = np.zeros((planes.shape[0], src.height + 1, src.width + 1), dtype=np.int64)
    table[:, 1:, 1:] = planes.cumsum(axis=1).cumsum(axis=2)
    out = spec.shapes[index]
    c, yx = np.divmod(mine, out.height * out.width)
    y, x = np.divmod(yx, out.width)
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    y0, y1 = np.clip(y * sh - ph, 0, src.height), np.clip(y * sh - ph + kh, 0, src.height)
    x0, x1 = np.clip(x * sw - pw, 0, src.width), np.clip(x * sw - pw + kw, 0, src.width)
    ch = c if pool else np.zeros_like(c)
    count = table[ch, y1, x1] - table[ch, y0, x1] - table[ch, y1, x0] + table[ch, y0, x0]
    return mine[count == 0]


def plan_schedule(
    spec: ModelSpec,
    plan: PartitionPlan,
    *,
    validate: bool = True,
    overlap: bool = True,
    split_min_flops: float = SPLIT_MIN_FLOPS,
    split: tuple[bool, ...] | None = None,
) -> tuple[UnitGraph, HaloSchedule]:
    """The unit graph and halo schedule of `plan` for `spec`, checked against the plan files.

    `validate=False` only where the same plan was validated already (worker processes of a
    launcher that validated before starting them). `split`: per layer whether to split it
    (default: the plan's choice, `LayerFigures.split`; () every layer that can be).
    """
    plan.check_model(spec)
    graph = build_unit_graph(spec, plan.granularity)
    schedule = build_schedule(
        graph,
        plan.node_map,
        plan.workers,
        overlap=overlap,
        split_min_flops=split_min_flops,
        split=tuple(layer.split for layer in plan.layers) if split is None else split,
    )
    if validate:
        schedule.validate(plan)
    return graph, schedule
