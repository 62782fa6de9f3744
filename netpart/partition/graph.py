"""The unit graph: blocks of units as vertices, "reads" as edges, in symmetric CSR form.

Each layer's output (C x H x W; dense layers C x 1 x 1) is cut into a regular grid of blocks:
`nc` channel groups x `ny` row bands x `nx` column bands, with bounds split as evenly as integers
allow. A block is one vertex; block ids are contiguous per layer, ordered (group, row, column).
Vertex weight is the block's forward+backward FLOPs per example, vertex size its activation
values per example; an edge joins a block to every block of its layer's sources it reads (the
layer below in a chain; in a layer graph, the layers it names: a skip edge joins a merge to a
block far below), and its weight is the number of units read. The network input is data, not a
layer: every worker reads the input pixels it needs from its batch, so it makes no edges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import Granularity, LayerBlocks, even_bounds
from netpart.partition.reads import edge_count, read_edges, read_pairs, symmetric_csr

__all__ = [
    "GraphSize",
    "UnitGraph",
    "aligned_pool",
    "build_unit_graph",
    "flops_per_unit",
    "graph_size",
    "narrow",
    "owned_units",
]


@dataclass(frozen=True, eq=False)
class UnitGraph:
    """Blocks of units with FLOPs, sizes, read edges and symmetric CSR adjacency (`xadj`,
    `adjncy`, `adjwgt`: built from the read edges on first use).

    Invariants: every unit of every layer lies in exactly one block; the adjacency is symmetric
    with equal weights both ways and each row ascending; `box[v] = (c0, c1, y0, y1, x0, x1)`
    is block v's unit range. The arrays are read-only.
    """

    spec: ModelSpec
    granularity: Granularity
    layers: tuple[LayerBlocks, ...]
    layer_of: np.ndarray
    box: np.ndarray
    flops: np.ndarray
    units: np.ndarray
    # Every edge once as (reader, source, units read), readers ascending and each reader's
    # sources ascending (so grouped by the readers' layer).
    reads: tuple[np.ndarray, np.ndarray, np.ndarray]

    @property
    def num_vertices(self) -> int:
        return len(self.layer_of)

    @property
    def num_edges(self) -> int:
        return len(self.reads[0])

    @property
    def xadj(self) -> np.ndarray:
        return self._csr[0]

    @property
    def adjncy(self) -> np.ndarray:
        return self._csr[1]

    @property
    def adjwgt(self) -> np.ndarray:
        return self._csr[2]

    @cached_property
    def _csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The CSR arrays, built on first use (METIS and the balance repair need them; the
        figures of a plan read `reads`)."""
        sources = [tuple(sorted(set(self.spec.sources(i)) - {-1})) for i in range(len(self.layers))]
        arrays = symmetric_csr(*self.reads, self.layers, sources)
        for array in arrays:
            array.flags.writeable = False
        return arrays

    @cached_property
    def read_cuts(self) -> np.ndarray:
        """[L + 1]: where each reader layer's edges begin in `reads` (layer 0 reads none)."""
        firsts = [lb.first for lb in self.layers] + [self.num_vertices]
        return np.searchsorted(self.reads[0], np.asarray(firsts, dtype=self.reads[0].dtype))

    def edge_list(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(u, v, w) for each undirected edge once, u < v (computed once per graph)."""
        return self._edges

    @cached_property
    def _edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.repeat(np.arange(self.num_vertices), np.diff(self.xadj))
        keep = src < self.adjncy
        return src[keep], self.adjncy[keep], self.adjwgt[keep]

    def to_networkx(self, max_vertices: int = 20000):
        """A networkx view (small graphs only): node attrs layer/flops/units/box, edge weight."""
        import networkx as nx  # only for exports: workers and planning never load it

        if self.num_vertices > max_vertices:
            raise ValueError(
                f"graph has {self.num_vertices} vertices; networkx export is for <= {max_vertices}"
            )
        g = nx.Graph(model=self.spec.name)
        for v in range(self.num_vertices):
            g.add_node(
                v,
                layer=int(self.layer_of[v]),
                flops=int(self.flops[v]),
                units=int(self.units[v]),
                box=tuple(int(b) for b in self.box[v]),
            )
        u, w_, wt = self.edge_list()
        g.add_weighted_edges_from(zip(u.tolist(), w_.tolist(), wt.tolist(), strict=True))
        return g

    def to_metis_text(self, per_layer_constraints: bool = True) -> str:
        """METIS `.graph` text (1-based): vertex sizes, weights (one per layer), edge weights."""
        ncon = len(self.layers) if per_layer_constraints else 1
        weights = self.vertex_weights(per_layer_constraints)
        head = f"{self.num_vertices} {self.num_edges} 111" + (f" {ncon}" if ncon > 1 else "")
        lines = [head]
        for v in range(self.num_vertices):
            lo, hi = self.xadj[v], self.xadj[v + 1]
            pairs = np.stack([self.adjncy[lo:hi] + 1, self.adjwgt[lo:hi]], axis=1).ravel()
            lines.append(" ".join(map(str, [self.units[v], *weights[v], *pairs])))
        return "\n".join(lines) + "\n"

    def vertex_weights(self, per_layer_constraints: bool = True) -> np.ndarray:
        """[V, ncon] int64: FLOPs in the column of the vertex's layer (or one column of all)."""
        if not per_layer_constraints:
            return self.flops[:, None].copy()
        w = np.zeros((self.num_vertices, len(self.layers)), dtype=np.int64)
        w[np.arange(self.num_vertices), self.layer_of] = self.flops
        return w


def flops_per_unit(spec: ModelSpec, index: int) -> int:
    """Forward+backward FLOPs per output unit (backward ~2x forward with weights, ~1x without;
    an add one sum per extra input, a concat a copy, a batch norm its statistics, the
    normalisation and the affine map, and their gradients)."""
    layer, src = spec.layers[index], spec.input_shape(index)
    if layer.kind in ("local", "conv"):
        return 3 * (2 * src.channels * layer.window + 2)
    if layer.kind == "dense":
        return 3 * (2 * src.size + 2)
    if layer.kind == "pool":
        return 2 * (2 * layer.window + 1)
    if layer.kind == "add":
        return 2 * len(spec.sources(index))
    if layer.kind == "concat":
        return 2
    if layer.kind == "batchnorm":
        return 2 * 8
    return 2 * (4 * layer.window + 4)


def aligned_pool(spec: ModelSpec, index: int) -> bool:
    """True when layer `index` is a pool whose square windows tile its input (kernel = stride,
    no padding): an input cut at stride x the pool's cut sends the pool nothing."""
    layer = spec.layers[index]
    square = isinstance(layer.kernel, int)
    alone = len(spec.sources(index)) == 1
    return (
        layer.kind == "pool"
        and alone
        and square
        and layer.kernel == layer.stride
        and not layer.padding
    )


def _layer_blocks(spec: ModelSpec, granularity: Granularity) -> tuple[LayerBlocks, ...]:
    """Each layer's block bounds; built last layer first, so a pool's input can follow it."""
    n = len(spec.layers)
    bounds: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # filled last layer first
    for i in range(n - 1, -1, -1):
        layer, shape = spec.layers[i], spec.shapes[i]
        nc, ny, nx = granularity.grid(shape, dense=spec.is_flat(i))
        cb = even_bounds(shape.channels, nc)
        yb, xb = even_bounds(shape.height, ny), even_bounds(shape.width, nx)
        if (
            granularity.align_pools
            and not spec.is_flat(i)
            and i + 1 < n
            and aligned_pool(spec, i + 1)
            and spec.sources(i + 1) == (i,)
        ):
            stride = spec.layers[i + 1].stride
            pool_c, pool_y, pool_x = bounds[0]
            # The pool's channel groups where that keeps the layer near the blocks it wants (a
            # reader of all channels reads every group) and its tiles fine enough, else its own
            # groups; bands as fine as wanted, else the pool's.
            natural, most = nc * ny * nx, granularity.max_blocks
            tries = [
                (pool_c, (ny, nx), min(most, 2 * natural), 0),
                (pool_c, (1, 1), natural, granularity.spatial_blocks // 2),
                (cb, (ny, nx), most, 0),
                (cb, (1, 1), most, 0),
            ]
            for ca, (want_y, want_x), limit, tiles in tries:
                ya = _stretched(pool_y, stride, shape.height, want_y)
                xa = _stretched(pool_x, stride, shape.width, want_x)
                positions = (len(ya) - 1) * (len(xa) - 1)
                if (len(ca) - 1) * positions <= limit and positions >= tiles:
                    cb, yb, xb = ca, ya, xa
                    break
        bounds.insert(0, (cb, yb, xb))
    out, first = [], 0
    for i, (layer, shape) in enumerate(zip(spec.layers, spec.shapes, strict=True)):
        cb, yb, xb = bounds[i]
        out.append(LayerBlocks(i, layer.kind, shape, cb, yb, xb, first))
        first += out[-1].count
    return tuple(out)


def _stretched(reader: np.ndarray, stride: int, n: int, want: int) -> np.ndarray:
    """Bounds over n rows read by `reader` bands through stride-wide windows: stride x the
    reader's, each band split in about want / bands even parts, and the unread rest (if any)
    a band of its own."""
    parts = max(1, round(want / (len(reader) - 1)))
    b = reader * stride
    split = (b[:-1, None] + (np.diff(b)[:, None] * np.arange(parts)[None, :]) // parts).ravel()
    out = np.unique(np.append(split, b[-1]))
    return out if out[-1] == n else np.append(out, n)


def _boxes(lb: LayerBlocks) -> np.ndarray:
    gc, gy, gx = np.unravel_index(np.arange(lb.count), (lb.nc, lb.ny, lb.nx))
    return np.stack(
        [
            lb.cbounds[gc],
            lb.cbounds[gc + 1],
            lb.ybounds[gy],
            lb.ybounds[gy + 1],
            lb.xbounds[gx],
            lb.xbounds[gx + 1],
        ],
        axis=1,
    )


def build_unit_graph(spec: ModelSpec, granularity: Granularity | None = None) -> UnitGraph:
    """Blocks, FLOPs, sizes and symmetric CSR adjacency for `spec` (vectorised numpy).

    The last graph built is kept (a plan's candidates of one granularity, and the command
    that reports the plan, share it): graphs are immutable (their arrays are read-only).
    A layer graph's skip edges join a layer to the sources it names."""
    return _build(spec, granularity or Granularity())


@dataclass(frozen=True)
class GraphSize:
    """What a graph will hold, known before it is built: its blocks, the blocks of its
    widest layer (the most workers that can each own a part of one layer) and that layer's
    name, its read edges (counted per reader block), and its distinct block grids and their
    blocks (what METIS weighs for a layer graph: `netpart.partition.stacks`)."""

    blocks: int
    widest: int
    widest_layer: str
    edges: int
    grids: int
    grid_blocks: int


def graph_size(spec: ModelSpec, granularity: Granularity) -> GraphSize:
    """The `GraphSize` of the graph `build_unit_graph` would build, without building it."""
    layers = _layer_blocks(spec, granularity)
    box = np.concatenate([_boxes(lb) for lb in layers])
    edges = sum(
        edge_count(spec, layers[i], layers[source], box, slot)
        for i, slot, source in read_pairs(spec)
    )
    wide = max(layers, key=lambda lb: lb.count)
    grids = {
        (lb.shape, tuple(lb.cbounds), tuple(lb.ybounds), tuple(lb.xbounds)): lb.count
        for lb in layers
    }
    return GraphSize(
        len(box), wide.count, spec.layer_name(wide.index), edges, len(grids), sum(grids.values())
    )


@functools.lru_cache(maxsize=1)
def _build(spec: ModelSpec, granularity: Granularity) -> UnitGraph:
    layers = _layer_blocks(spec, granularity)
    box = np.concatenate([_boxes(lb) for lb in layers])
    layer_of = np.concatenate([np.full(lb.count, lb.index, dtype=np.int64) for lb in layers])
    units = (box[:, 1] - box[:, 0]) * (box[:, 3] - box[:, 2]) * (box[:, 5] - box[:, 4])
    per_unit = np.array([flops_per_unit(spec, i) for i in range(len(layers))], dtype=np.int64)
    flops = units * per_unit[layer_of]
    parts = [_layer_reads(spec, layers, box, i) for i in range(1, len(layers))]
    rd, sr, wt = (_joined(parts, k) for k in range(3))
    graph = UnitGraph(
        spec=spec,
        granularity=granularity,
        layers=layers,
        layer_of=layer_of,
        box=box,
        flops=flops,
        units=units,
        reads=(rd, sr, wt),
    )
    for array in (layer_of, box, flops, units, rd, sr, wt):
        array.flags.writeable = False
    return graph


def _layer_reads(
    spec: ModelSpec, layers: tuple[LayerBlocks, ...], box: np.ndarray, index: int
) -> list[np.ndarray]:
    """Layer `index`'s read edges from all its sources, each reader's sources ascending
    (one source: as read; several, a merge: sorted, and a source read twice, `x + x`, one
    edge of the summed units)."""
    reads = [
        read_edges(spec, layers[index], layers[source], box, slot)
        for reader, slot, source in read_pairs(spec)
        if reader == index
    ]
    if not reads:
        empty = np.zeros(0, dtype=np.int32)
        return [empty, empty, empty]
    if len(reads) == 1:
        return list(reads[0])
    rd, sr, wt = (np.concatenate([r[k] for r in reads]) for k in range(3))
    order = np.lexsort((sr, rd))
    rd, sr, wt = rd[order], sr[order], wt[order]
    first = np.ones(len(rd), dtype=bool)
    first[1:] = (rd[1:] != rd[:-1]) | (sr[1:] != sr[:-1])
    at = np.flatnonzero(first)
    return [rd[at], sr[at], np.add.reduceat(wt, at) if len(at) else wt]


def narrow(node_map: np.ndarray) -> np.ndarray:
    """The node map in int16 (int32 past 32767 workers): gathered over every edge of a
    large graph, the narrow copy moves a quarter of the bytes."""
    small = np.int16 if len(node_map) == 0 or node_map.max() < 2**15 else np.int32
    return node_map.astype(small)


def _joined(parts: list[list[np.ndarray]], k: int) -> np.ndarray:
    """The k-th arrays of `parts` end to end; each part is let go once copied (the edges of
    a large graph are hundreds of MB an array)."""
    if not parts:
        return np.zeros(0, dtype=np.int32)
    out = np.concatenate([p[k] for p in parts])
    for p in parts:
        p[k] = None
    return out


def owned_units(graph: UnitGraph, node_map: np.ndarray, workers: int) -> tuple:
    """owned[l][w]: the sorted flat units of layer l that worker w computes."""
    out = []
    for lb in graph.layers:
        owner = lb.owner_grid(node_map)  # [G, H, W]
        per_channel = np.repeat(owner, np.diff(lb.cbounds), axis=0).ravel()
        order = np.argsort(per_channel, kind="stable")
        cuts = np.searchsorted(per_channel[order], np.arange(workers + 1))
        out.append(tuple(order[cuts[w] : cuts[w + 1]] for w in range(workers)))
    return tuple(out)
