"""Where every parameter lives: worker parameter pieces and the parameter-server shard layout.

A worker holds its parameters as *pieces*, one tensor per (layer, weight|bias, channel group):
a locally connected group's filters for the positions it owns, a dense layer's rows for the
neurons it owns, a conv channel group's kernel, or a batch norm channel group's scale and
shift (the two pieces several workers can share).

The parameter space is *worker-major*: worker 0's pieces in order, then the pieces of worker 1
no earlier worker holds, and so on. Shard s holds the range [bounds[s], bounds[s+1]) of that
space. The cut rule (deterministic, no hashing) places cuts one after another: each aims at an
equal share of what remains and moves to the nearest worker boundary when one lies within 5% of
a share. With S = N and workers balanced within 5%, shard w holds exactly worker w's parameters
and model worker w of every replica talks to shard w only; otherwise shards stay balanced and a
worker may straddle two shards. Every piece
maps to one contiguous range, so a message between a worker and a shard is a handful of
contiguous segments, computed identically on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from netpart.models.init import init_rows
from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks
from netpart.partition.graph import UnitGraph, owned_units

__all__ = [
    "ParamPiece",
    "Segment",
    "ShardLayout",
    "channel_groups",
    "layer_pieces",
    "piece_index",
    "piece_initial",
    "shard_bounds",
]

SNAP = 0.05  # a cut moves to a worker boundary within this fraction of a share


@dataclass(frozen=True, eq=False)
class ParamPiece:
    """One parameter tensor of one worker. `rows`: owned positions (local), units (dense)."""

    layer: int
    param: str  # "weight" | "bias"
    kind: str  # layer kind
    c0: int
    c1: int
    rows: np.ndarray
    size: int

    @property
    def name(self) -> str:
        """The reference module's parameter name."""
        return f"layers.{self.layer}.{self.param}"

    @property
    def shared(self) -> bool:
        """Conv kernels and batch norms' scales and shifts are tied: every worker computing
        channel group c0..c1 holds a copy."""
        return self.kind in ("conv", "batchnorm")


def channel_groups(
    spec: ModelSpec, index: int, units: np.ndarray, blocks: LayerBlocks
) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """(c0, c1, owned positions, selection into `units`) per channel group a worker computes."""
    out = spec.shapes[index]
    channel, position = np.divmod(units, out.height * out.width)
    group = np.searchsorted(blocks.cbounds, channel, side="right") - 1
    groups = []
    for g in np.unique(group):
        c0, c1 = int(blocks.cbounds[g]), int(blocks.cbounds[g + 1])
        sel = np.nonzero(group == g)[0]
        positions = np.unique(position[sel])
        # Each owned block covers whole channel groups: rows are (position, channel).
        assert len(sel) == len(positions) * (c1 - c0), "blocks must hold whole channel groups"
        groups.append((c0, c1, positions, sel))
    return groups


def layer_pieces(
    spec: ModelSpec,
    index: int,
    units: np.ndarray,
    blocks: LayerBlocks,
    groups: list[tuple[int, int, np.ndarray, np.ndarray]] | None = None,
) -> list[ParamPiece]:
    """The pieces of layer `index` a worker owning `units` holds, in its slice's order
    (`groups`: its `channel_groups`, when the caller has them already)."""
    layer, src = spec.layers[index], spec.input_shape(index)
    kind = layer.kind
    empty = np.zeros(0, dtype=np.int64)
    bias = layer.has_bias  # a layer without one has weight pieces alone
    if kind == "dense":
        n_in = src.size
        pieces = [ParamPiece(index, "weight", kind, 0, 0, units, len(units) * n_in)]
        return pieces + ([ParamPiece(index, "bias", kind, 0, 0, units, len(units))] if bias else [])
    if kind == "batchnorm":
        if groups is None:
            groups = channel_groups(spec, index, units, blocks)
        return [
            ParamPiece(index, param, kind, c0, c1, empty, c1 - c0)
            for c0, c1, _, _ in groups
            for param in ("weight", "bias")
        ]
    if kind not in ("local", "conv"):
        return []
    k_in = src.channels * layer.window
    pieces = []
    if groups is None:
        groups = channel_groups(spec, index, units, blocks)
    for c0, c1, pos, _ in groups:
        cg = c1 - c0
        rows = pos if kind == "local" else empty  # untied: per position; tied: one kernel
        count = len(pos) if kind == "local" else 1
        pieces.append(ParamPiece(index, "weight", kind, c0, c1, rows, count * cg * k_in))
        if bias:
            pieces.append(ParamPiece(index, "bias", kind, c0, c1, rows, count * cg))
    return pieces


def piece_index(spec: ModelSpec, piece: ParamPiece) -> np.ndarray:
    """Flat indices into the reference parameter `piece.name`, in the piece's element order.

    Local weight [Q, cg, K] of reference [positions, K, Cout]; local bias [Q, cg] of [C, H, W];
    conv weight [cg, K] of [Cout, Cin, k, k]; dense weight [U, n_in]; biases by channel/unit.
    """
    layer, src = spec.layers[piece.layer], spec.input_shape(piece.layer)
    out = spec.shapes[piece.layer]
    ch = np.arange(piece.c0, piece.c1)
    if piece.kind == "batchnorm":
        return ch
    if piece.kind == "dense":
        if piece.param == "bias":
            return piece.rows.astype(np.int64)
        return (piece.rows[:, None] * src.size + np.arange(src.size)[None, :]).ravel()
    k_in = src.channels * layer.window
    if piece.kind == "conv":
        if piece.param == "bias":
            return ch
        return (ch[:, None] * k_in + np.arange(k_in)[None, :]).ravel()
    pos = piece.rows
    if piece.param == "bias":
        return (ch[None, :] * (out.height * out.width) + pos[:, None]).ravel()
    k = np.arange(k_in)
    flat = (pos[:, None, None] * k_in + k[None, None, :]) * out.channels + ch[None, :, None]
    return flat.ravel()


def piece_initial(spec: ModelSpec, seed: int, piece: ParamPiece) -> np.ndarray:
    """The reference's initial values of `piece`, float64, flat in the piece's element order."""
    if piece.param == "bias":
        return np.zeros(piece.size)
    if piece.kind == "batchnorm":  # torch's BatchNorm: a scale of 1
        return np.ones(piece.size)
    if piece.kind == "dense":
        return init_rows(spec, seed, piece.layer, piece.rows).reshape(-1)
    if piece.kind == "conv":
        full = init_rows(spec, seed, piece.layer, np.array([0]))[0]  # [Cout, Cin, k, k]
        return full[piece.c0 : piece.c1].reshape(-1)
    rows = init_rows(spec, seed, piece.layer, piece.rows)  # [Q, K, Cout]
    return np.ascontiguousarray(rows[:, :, piece.c0 : piece.c1].transpose(0, 2, 1)).reshape(-1)


def shard_bounds(first_held: np.ndarray, shards: int) -> np.ndarray:
    """S + 1 cut points in the worker-major space (see the module docstring for the rule)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    edges = np.concatenate([[0], np.cumsum(first_held, dtype=np.int64)])
    total = int(edges[-1])
    cuts = [0]
    for k in range(1, shards):  # a loop over shards, not parameters
        share = (total - cuts[-1]) / (shards - k + 1)
        target = cuts[-1] + share
        i = int(np.argmin(np.abs(edges - target)))
        snapped = int(edges[i]) if abs(edges[i] - target) <= SNAP * share else round(target)
        cuts.append(max(snapped, cuts[-1]))
    cuts.append(total)
    return np.asarray(cuts, dtype=np.int64)


@dataclass(frozen=True)
class Segment:
    """Values [local_lo, +length) of a worker's flat vector are [shard_lo, +length) of a shard."""

    local_lo: int
    shard_lo: int
    length: int


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Pieces of every worker, their worker-major offsets, and the shard cut points."""

    workers: int
    shards: int
    pieces: tuple[tuple[ParamPiece, ...], ...]  # [worker] -> pieces in slice order
    offsets: tuple[np.ndarray, ...]  # [worker] -> worker-major offset of each piece
    first_held: np.ndarray  # [worker] values first held by that worker
    bounds: np.ndarray  # [shards + 1]

    @classmethod
    def build(
        cls, graph: UnitGraph, node_map: np.ndarray, workers: int, shards: int
    ) -> ShardLayout:
        """The layout of a plan's parameters over `shards` shards (pure)."""
        spec = graph.spec
        owned = owned_units(graph, node_map, workers)
        pieces = tuple(
            tuple(
                p
                for i, lb in enumerate(graph.layers)
                for p in layer_pieces(spec, i, owned[i][w], lb)
            )
            for w in range(workers)
        )
        seen: dict[tuple[int, str, int], int] = {}
        offsets, first_held, cursor = [], np.zeros(workers, dtype=np.int64), 0
        for w in range(workers):  # a loop over pieces (tens per worker), not over units
            offs = np.empty(len(pieces[w]), dtype=np.int64)
            for j, p in enumerate(pieces[w]):
                key = (p.layer, p.param, p.c0)
                if p.shared and key in seen:
                    offs[j] = seen[key]
                    continue
                offs[j] = cursor
                if p.shared:
                    seen[key] = cursor
                cursor += p.size
                first_held[w] += p.size
            offsets.append(offs)
        bounds = shard_bounds(first_held, shards)
        return cls(workers, shards, pieces, tuple(offsets), first_held, bounds)

    @property
    def total(self) -> int:
        """Distinct parameters (= the reference model's parameter count)."""
        return int(self.bounds[-1])

    def shard_sizes(self) -> np.ndarray:
        """[shards] parameters held by each shard."""
        return np.diff(self.bounds)

    def worker_size(self, worker: int) -> int:
        """Length of a worker's flat parameter vector (its pieces concatenated)."""
        return int(sum(p.size for p in self.pieces[worker]))

    def routes(self, worker: int) -> dict[int, tuple[Segment, ...]]:
        """Per shard, the segments of `worker`'s flat vector it holds (merged where contiguous)."""
        return self._routes[worker]

    @cached_property
    def _routes(self) -> tuple[dict[int, tuple[Segment, ...]], ...]:
        return tuple(self._compute_routes(w) for w in range(self.workers))

    def _compute_routes(self, worker: int) -> dict[int, tuple[Segment, ...]]:
        sizes = np.array([p.size for p in self.pieces[worker]], dtype=np.int64)
        keep = sizes > 0
        local = (np.cumsum(sizes) - sizes)[keep]
        start, sizes = self.offsets[worker][keep], sizes[keep]
        # Split every piece range at the shard cuts it straddles.
        first = np.searchsorted(self.bounds, start, side="right") - 1
        last = np.searchsorted(self.bounds, start + sizes - 1, side="right") - 1
        count = last - first + 1
        which = np.repeat(np.arange(len(start)), count)
        shard = first[which] + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))
        lo = np.maximum(start[which], self.bounds[shard])
        hi = np.minimum(start[which] + sizes[which], self.bounds[shard + 1])
        local_lo = local[which] + lo - start[which]
        out: dict[int, list[Segment]] = {}
        columns = (shard.tolist(), local_lo.tolist(), lo.tolist(), (hi - lo).tolist())
        for s, a, g, n in zip(*columns, strict=True):
            segs = out.setdefault(s, [])
            if (
                segs
                and segs[-1].local_lo + segs[-1].length == a
                and (segs[-1].shard_lo + segs[-1].length == g - self.bounds[s])
            ):
                segs[-1] = Segment(segs[-1].local_lo, segs[-1].shard_lo, segs[-1].length + n)
            else:
                segs.append(Segment(a, g - int(self.bounds[s]), n))
        return {s: tuple(v) for s, v in sorted(out.items())}

    def peers(self, shard: int) -> list[int]:
        """Workers (of every replica) that talk to `shard`."""
        return [w for w in range(self.workers) if shard in self.routes(w)]

    def describe(self) -> dict:
        """Figures for reports: values per shard and which workers each shard serves."""
        return {
            "shards": self.shards,
            "values": [int(x) for x in self.shard_sizes()],
            "workers_of_shard": [self.peers(s) for s in range(self.shards)],
        }
