"""Who reads whom: the read edges between the blocks of consecutive layers, and their
symmetric CSR form (what METIS reads).

A block of layer i reads, through its layer's window, a box of layer i - 1's units; the
blocks of layer i - 1 that box meets are its sources, and an edge's weight is the number of
units read. Edge arrays are the size of the graph (tens of millions of entries for a large
model on hundreds of workers), so they are int32 where the values fit and the CSR is built
one reader layer at a time.
"""

from __future__ import annotations

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks

__all__ = ["edge_count", "needed_boxes", "read_edges", "read_window", "symmetric_csr"]


def read_window(spec: ModelSpec, index: int) -> tuple[tuple[int, int], ...]:
    """((kernel), (stride), (padding)), each (height, width), through which spatial layer
    `index` reads its input."""
    layer = spec.layers[index]
    if layer.kind == "lcn":
        k = layer.kernel
        return (k, k), (1, 1), (k // 2, k // 2)
    return layer.kernel_hw, layer.stride_hw, layer.padding_hw


def needed_boxes(spec: ModelSpec, index: int, boxes: np.ndarray) -> np.ndarray:
    """For reader blocks of layer `index` (boxes [B, 6]), the input-unit box each one reads."""
    src = spec.input_shape(index)
    layer = spec.layers[index]
    n = len(boxes)
    if not layer.is_spatial:
        full = np.array([0, src.channels, 0, src.height, 0, src.width], dtype=np.int64)
        return np.broadcast_to(full, (n, 6)).copy()
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    need = np.empty((n, 6), dtype=np.int64)
    if layer.kind == "pool":
        need[:, 0:2] = boxes[:, 0:2]
    else:
        need[:, 0], need[:, 1] = 0, src.channels
    need[:, 2] = np.clip(boxes[:, 2] * sh - ph, 0, src.height)
    need[:, 3] = np.clip((boxes[:, 3] - 1) * sh - ph + kh, 0, src.height)
    need[:, 4] = np.clip(boxes[:, 4] * sw - pw, 0, src.width)
    need[:, 5] = np.clip((boxes[:, 5] - 1) * sw - pw + kw, 0, src.width)
    return need


def read_edges(
    spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, boxes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reader id, source id, units read) for every block pair where the reader reads the
    source: readers ascending, each one's sources ascending. A window is a product of ranges
    of channels, rows and columns, so a pair's units are the product of three overlaps: the
    pairs are grown one dimension at a time, each partial pair repeated once per band of
    the next dimension it reads (no division: these arrays are the size of the edges)."""
    rb = boxes[reader.first : reader.first + reader.count]
    dims = _windows(spec, reader, source, rb)
    total = int((dims[0][2] * dims[1][2] * dims[2][2]).sum())
    ids = _small(max(source.first + source.count, reader.first + reader.count, total))
    biggest = max(int(d[3].max(initial=0)) for d in dims)
    weights = _small(biggest**3)
    parent = np.arange(len(rb), dtype=ids)  # the reader of each partial pair
    sid, units = np.zeros(len(rb), dtype=ids), np.ones(len(rb), dtype=weights)
    for size, first, count, inside, at in dims:
        per = count.astype(ids)[parent]  # bands of this dimension each partial pair reads
        starts = np.cumsum(per, dtype=ids) - per
        k = np.arange(int(per.sum()), dtype=ids)
        sid = np.repeat(sid * size + first.astype(ids)[parent] - starts, per) + k
        band = k - np.repeat(starts - at.astype(ids)[parent], per)
        units = np.repeat(units, per) * inside.astype(weights)[band]
        parent = np.repeat(parent, per)
    return parent + reader.first, sid + source.first, units


def edge_count(spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, boxes: np.ndarray) -> int:
    """How many read edges `read_edges` would give (computed per reader block, not per edge:
    cheap enough to decide whether a graph fits in memory before building it)."""
    rb = boxes[reader.first : reader.first + reader.count]
    counts = [d[2] for d in _windows(spec, reader, source, rb)]
    return int((counts[0] * counts[1] * counts[2]).sum())


def _windows(spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, rb: np.ndarray) -> list:
    """Per dimension (channels, rows, columns) of the source: its band count, and for each
    reader block the first band it reads, how many, their overlaps with its window (flat)
    and where each reader's overlaps start."""
    need = needed_boxes(spec, reader.index, rb)
    dims = []
    for col, bounds in ((0, source.cbounds), (2, source.ybounds), (4, source.xbounds)):
        first, end = _range_of(bounds, need[:, col], need[:, col + 1])
        count = end - first
        inside, at = _band_overlaps(bounds, need[:, col], need[:, col + 1], first, count)
        dims.append((len(bounds) - 1, first, count, inside, at))
    return dims


def symmetric_csr(
    rd: np.ndarray, sr: np.ndarray, wt: np.ndarray, layers: tuple[LayerBlocks, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric CSR (xadj, adjncy, adjwgt; int64, what METIS reads) of the read edges
    (`rd` ascending, each reader's sources ascending), each row's neighbours ascending:
    its sources (lower ids: the layer below), then its readers (the layer above).

    A row's first slots hold its sources, the rest its readers (`forward` marks which).
    Layer i's blocks are read by layer i + 1's only, so one reader layer's edges fill the
    source slots of that layer's rows, in edge order, and the reader slots of the layer
    below's rows, in source order: a stable sort of the sources (radix: a layer's block
    offsets fit 16 bits). One layer at a time bounds the temporaries."""
    vertices = layers[-1].first + layers[-1].count if layers else 0
    deg_f = np.bincount(rd, minlength=vertices)
    deg_b = np.bincount(sr, minlength=vertices)
    xadj = np.zeros(vertices + 1, dtype=np.int64)
    np.cumsum(deg_f + deg_b, out=xadj[1:])
    slots = np.stack([deg_f, deg_b], axis=1).ravel()
    forward = np.repeat(np.tile(np.array([True, False]), vertices), slots)
    adjncy = np.empty(2 * len(rd), dtype=np.int64)
    adjwgt = np.empty(2 * len(rd), dtype=np.int64)
    ends = np.searchsorted(rd, [lb.first + lb.count for lb in layers[1:]])
    begin = 0
    for source, reader, end in zip(layers[:-1], layers[1:], ends, strict=True):
        rows = slice(xadj[reader.first], xadj[reader.first + reader.count])
        into = forward[rows]
        adjncy[rows][into], adjwgt[rows][into] = sr[begin:end], wt[begin:end]
        local = sr[begin:end] - source.first
        order = np.argsort(
            local.astype(np.uint16 if source.count <= 1 << 16 else np.int64), kind="stable"
        )
        del local
        rows = slice(xadj[source.first], xadj[source.first + source.count])
        into = ~forward[rows]
        adjncy[rows][into], adjwgt[rows][into] = rd[begin:end][order], wt[begin:end][order]
        begin = end
    return xadj, adjncy, adjwgt


def _small(bound: int) -> type:
    """int32 if every value is below `bound` (and so fits), else int64."""
    return np.int32 if bound < 2**31 else np.int64


def _range_of(bounds: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices [a, b) of the bands of `bounds` that intersect [lo, hi) (empty if lo >= hi)."""
    a = np.searchsorted(bounds, lo, side="right") - 1
    b = np.searchsorted(bounds, hi, side="left")
    return a, np.maximum(b, a)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes `counts`: (group index, offset within group) of every element
    (int32 where they fit: these arrays are the size of a layer's edges)."""
    small = _small(int(counts.sum()))
    owner = np.repeat(np.arange(len(counts), dtype=small), counts)
    starts = (np.cumsum(counts) - counts).astype(small)
    return owner, np.arange(counts.sum(), dtype=small) - starts[owner]


def _band_overlaps(bounds: np.ndarray, lo, hi, first, count) -> tuple[np.ndarray, np.ndarray]:
    """For each reader i and each of its `count[i]` bands from `first[i]`: how many of the
    band's rows lie in the reader's window [lo[i], hi[i]) (flat), and where each reader's
    values start."""
    i, j = _expand(count)
    band = first[i] + j
    inside = np.minimum(hi[i], bounds[band + 1]) - np.maximum(lo[i], bounds[band])
    return inside, (np.cumsum(count) - count)
