"""HaloSchedule: who owns which units and which units go from whom to whom, as validated data.

Units of layer l are numbered by their flat index in the layer's (C, H, W) output. For each
layer l >= 1 the schedule lists, for every ordered pair of workers (s, d), the sorted units of
layer l-1 that s owns and d reads: in the forward pass s sends their activations to d, in the
backward pass d sends their gradients back to s. Each list is one message per phase, so every
send has exactly one matching receive of the same length; all messages of a phase are posted
together (non-blocking), so no ordering can deadlock. `instructions(worker)` is the per-worker
view; `validate` checks the pairing and the sizes against the plan before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netpart.errors import NetpartError
from netpart.models.spec import ModelSpec
from netpart.partition.graph import BYTES_PER_VALUE, UnitGraph, build_unit_graph, owned_units
from netpart.partition.planner import PartitionPlan
from netpart.partition.volume import coverage

__all__ = [
    "HaloSchedule",
    "Instruction",
    "ScheduleError",
    "ShapeMismatchError",
    "build_schedule",
    "plan_schedule",
]


class ScheduleError(NetpartError):
    """A schedule whose sends and receives do not pair up, or that contradicts its plan."""


class ShapeMismatchError(ScheduleError):
    """A message or buffer whose length differs from what the schedule says."""


@dataclass(frozen=True)
class Instruction:
    """One point-to-point message of one phase, as seen by one worker."""

    layer: int  # reader layer; the units belong to layer - 1
    phase: str  # "forward" (activations) or "backward" (gradients)
    op: str  # "send" or "recv"
    peer: int
    count: int  # units per example


@dataclass(frozen=True, eq=False)
class HaloSchedule:
    """owned[l][w]: sorted units of layer l owned by w. sends[l][(s, d)]: units of l-1, s -> d."""

    workers: int
    owned: tuple[tuple[np.ndarray, ...], ...]
    sends: tuple[dict[tuple[int, int], np.ndarray], ...]

    def instructions(self, worker: int) -> list[Instruction]:
        """This worker's messages, in execution order (forward by layer, backward reversed)."""
        out = []
        for phase, layers in (("forward", range(len(self.sends))), ("backward", None)):
            order = layers if layers is not None else range(len(self.sends) - 1, -1, -1)
            for layer in order:
                for (s, d), units in sorted(self.sends[layer].items()):
                    src, dst = (s, d) if phase == "forward" else (d, s)
                    if src == worker:
                        out.append(Instruction(layer, phase, "send", dst, len(units)))
                    if dst == worker:
                        out.append(Instruction(layer, phase, "recv", src, len(units)))
        return out

    def validate(self, plan: PartitionPlan | None = None) -> None:
        """Raise ScheduleError unless every send pairs with one receive of the same length,
        units are owned by their sender and not by their receiver, and (with `plan`) the
        per-layer and per-worker volumes equal the figures recorded in the plan."""
        for layer in range(1, len(self.sends)):
            owner = _owner_of_units(self.owned[layer - 1])
            for (s, d), units in self.sends[layer].items():
                if s == d or not (0 <= s < self.workers and 0 <= d < self.workers):
                    raise ScheduleError(f"layer {layer}: message {s} -> {d} has no valid peer")
                if np.any(owner[units] != s):
                    raise ScheduleError(
                        f"layer {layer}: worker {s} sends {d} units it does not own"
                    )
        sent: dict[tuple, int] = {}
        received: dict[tuple, int] = {}
        for w in range(self.workers):
            for ins in self.instructions(w):
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


def build_schedule(graph: UnitGraph, node_map: np.ndarray, workers: int) -> HaloSchedule:
    """The halo schedule of an assignment (pure; vectorised per layer)."""
    spec = graph.spec
    owned = owned_units(graph, node_map, workers)
    sends: list[dict[tuple[int, int], np.ndarray]] = [{}]
    for index in range(1, len(graph.layers)):
        source = graph.layers[index - 1]
        shape = source.shape
        n = shape.size
        owner = np.empty(n, dtype=np.int64)
        for w in range(workers):
            owner[owned[index - 1][w]] = w
        if spec.layers[index].is_spatial:
            covered, slab_bounds = coverage(graph, index, node_map, workers)
            # Expand slabs to channels: needed[w, c, y, x].
            needed = np.repeat(covered, np.diff(slab_bounds), axis=1).reshape(workers, n)
        else:
            readers = np.bincount(node_map[graph.layers[index].ids], minlength=workers) > 0
            needed = np.broadcast_to(readers[:, None], (workers, n))
        msgs: dict[tuple[int, int], np.ndarray] = {}
        for d in range(workers):
            units = np.nonzero(needed[d] & (owner != d))[0]
            if len(units) == 0:
                continue
            src = owner[units]
            order = np.argsort(src, kind="stable")
            cuts = np.searchsorted(src[order], np.arange(workers + 1))
            for s in np.nonzero(np.diff(cuts))[0]:
                msgs[(int(s), d)] = units[order[cuts[s] : cuts[s + 1]]]
        sends.append(msgs)
    return HaloSchedule(workers=workers, owned=owned, sends=tuple(sends))


def plan_schedule(
    spec: ModelSpec, plan: PartitionPlan, validate: bool = True
) -> tuple[UnitGraph, HaloSchedule]:
    """The unit graph and halo schedule of `plan` for `spec`, checked against the plan files.

    `validate=False` only where the same plan was validated already (worker processes of a
    launcher that validated before starting them).
    """
    plan.check_model(spec)
    graph = build_unit_graph(spec, plan.granularity)
    schedule = build_schedule(graph, plan.node_map, plan.workers)
    if validate:
        schedule.validate(plan)
    return graph, schedule
