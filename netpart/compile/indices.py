"""The index tables a worker's program reads and writes through, from its halo schedule.

Pure numpy, built once per worker before any step (the runtime turns them into tensor
indices): which units of each layer it owns; per layer and peer, which of its outputs below
it sends (positions among its owned units) and which units it receives; and, where producer
chains run, each chain layer's early and late units, which layers feed a chained layer, and
which of the early units each message of the chain sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from netpart.compile.schedule import HaloSchedule

__all__ = ["WorkerIndices", "worker_indices"]


@dataclass(frozen=True, eq=False)
class WorkerIndices:
    """Worker `rank`'s tables (every array sorted or in the order the schedule sends)."""

    rank: int
    owned: tuple[np.ndarray, ...]  # [layer] the units it computes
    first: tuple[np.ndarray | None, ...]  # [layer] its first part: a chain's early units, or
    # its interior (None: a bare schedule, never split)
    early: dict[int, np.ndarray]  # chain layer -> its early units
    late: dict[int, np.ndarray]  # chain layer -> the rest of its owned units
    feeds: frozenset[int]  # layers whose layer above is computed in chain parts
    # [layer] peer -> positions among the units it owns of the layer's input space (in a
    # chain, owned[layer - 1]; in a layer graph, its inputs' owned units end to end)
    sends: tuple[dict[int, np.ndarray], ...]
    recvs: tuple[dict[int, np.ndarray], ...]  # [layer] peer -> units of the input space
    early_sends: dict[int, dict[int, np.ndarray]]  # [layer] peer -> positions in early[layer-1]
    # [layer] (input layer, where its owned units land in the input space; None: the
    # network's input, every unit) for each layer its input space holds
    into: tuple[tuple[tuple[int, np.ndarray | None], ...], ...] = ()
    # [layer] peer -> (input layer, the message's rows of it, their positions among the
    # owned units of it), for a layer whose input space is not the layer below's alone
    split_sends: dict[int, dict[int, list[tuple[int, np.ndarray, np.ndarray]]]] = field(
        default_factory=dict
    )


def _into(schedule: HaloSchedule, owned: tuple, layer: int) -> tuple:
    """(input layer, where this worker's units of it land in `layer`'s input space) for each
    layer the input space holds (None for the network's input: every unit)."""
    if not schedule.inputs:
        return ((layer - 1, owned[layer - 1]),) if layer else ((-1, None),)
    out, at = [], 0
    for s in schedule.inputs[layer]:
        if s < 0:
            out.append((s, None))
            at += schedule.input_units
        else:
            out.append((s, owned[s] + at))
            at += sum(len(u) for u in schedule.owned[s])
    return tuple(out)


def _held(into: tuple) -> np.ndarray:
    """The units of a layer's input space a worker owns, sorted (`_into`'s, end to end)."""
    parts = [units for _, units in into if units is not None]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _by_input(
    schedule: HaloSchedule, owned: tuple, layer: int, positions: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(input layer, the message's rows of it, their positions among this worker's units of
    it) for a message of `layer` sending `positions` of its owned inputs."""
    out, first = [], 0
    for s in schedule.input_layers(layer):
        n = len(owned[s])
        mine = (positions >= first) & (positions < first + n)
        out.append((s, np.flatnonzero(mine), positions[mine] - first))
        first += n
    return out


def worker_indices(schedule: HaloSchedule, rank: int) -> WorkerIndices:
    """The tables of worker `rank` of `schedule` (pure)."""
    layers = len(schedule.owned)
    owned = tuple(schedule.owned[i][rank] for i in range(layers))
    chained = schedule.overlap and bool(schedule.early)
    early = {i: schedule.early[i][rank] for i in range(layers) if chained}
    early = {i: e for i, e in early.items() if len(e)}
    first = tuple(
        early[i] if i in early else schedule.interior[i][rank] if schedule.interior else None
        for i in range(layers)
    )
    chains = schedule.chains[rank] if schedule.overlap and schedule.chains else ()
    into = tuple(_into(schedule, owned, i) for i in range(layers))
    sends: list[dict[int, np.ndarray]] = [{}]
    recvs: list[dict[int, np.ndarray]] = [{}]
    for i in range(1, layers):
        mine = schedule.sends[i].items()
        held = _held(into[i])
        sends.append({d: np.searchsorted(held, u) for (s, d), u in mine if s == rank})
        recvs.append({s: u for (s, d), u in mine if d == rank})
    early_sends = {
        i + 1: {
            d: np.searchsorted(e, u) for (s, d), u in schedule.sends[i + 1].items() if s == rank
        }
        for i, e in early.items()
        if i + 1 < layers
    }
    split_sends = {
        i: {d: _by_input(schedule, owned, i, pos) for d, pos in sends[i].items()}
        for i in range(1, layers)
        if schedule.input_layers(i) != (i - 1,) or (schedule.inputs and -1 in schedule.inputs[i])
    }
    return WorkerIndices(
        rank=rank,
        into=into,
        split_sends=split_sends,
        owned=owned,
        first=first,
        early=early,
        late={i: np.setdiff1d(owned[i], e) for i, e in early.items()},
        feeds=frozenset(k for a, b in chains for k in range(a, b)),
        sends=tuple(sends),
        recvs=tuple(recvs),
        early_sends=early_sends,
    )
