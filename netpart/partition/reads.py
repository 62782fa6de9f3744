"""Who reads whom: the read edges between the blocks of a layer and the blocks of the layers
it reads, and their symmetric CSR form (what METIS reads).

A block of layer i reads, through its layer's window, a box of each of its sources' units
(the layer below in a chain; in a layer graph, the layers it names); the blocks of a source
that box meets are read, and an edge's weight is the number of units read. A merge (add,
concat) and a batch norm read pointwise, channel by channel: an add the same channels of
each source, a concat each source's channels at its offset. Edge arrays are the size of the
graph (tens of millions of entries for a large model on hundreds of workers), so they are
int32 where the values fit and the CSR is built one layer at a time.
"""

from __future__ import annotations

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks

__all__ = [
    "CHANNELWISE",
    "channel_offset",
    "edge_count",
    "needed_boxes",
    "read_edges",
    "read_pairs",
    "read_rows",
    "read_window",
    "source_shape",
    "symmetric_csr",
]

# Kinds whose output channel c reads its input's channel c only (at a concat's offset).
CHANNELWISE = ("pool", "add", "concat", "batchnorm")


def read_window(spec: ModelSpec, index: int) -> tuple[tuple[int, int], ...]:
    """((kernel), (stride), (padding)), each (height, width), through which layer `index`
    reads its inputs (a merge and a batch norm: one position)."""
    layer = spec.layers[index]
    if layer.kind == "lcn":
        k = layer.kernel
        return (k, k), (1, 1), (k // 2, k // 2)
    if layer.kernel is None:
        return (1, 1), (1, 1), (0, 0)
    return layer.kernel_hw, layer.stride_hw, layer.padding_hw


def read_pairs(spec: ModelSpec) -> list[tuple[int, int, int]]:
    """(reader, slot, source) for every layer's every input that is a layer (the network's
    input is data: it makes no edges), readers ascending."""
    return [
        (i, slot, source)
        for i in range(len(spec.layers))
        for slot, source in enumerate(spec.sources(i))
        if source >= 0
    ]


def source_shape(spec: ModelSpec, index: int, slot: int):
    """The shape of layer `index`'s input `slot` (the network's input for -1)."""
    source = spec.sources(index)[slot]
    return spec.input.shape if source < 0 else spec.shapes[source]


def channel_offset(spec: ModelSpec, index: int, slot: int) -> int:
    """Where input `slot`'s channels begin among layer `index`'s output channels (a
    concat's side-by-side sources; 0 for every other kind)."""
    if spec.layers[index].kind != "concat":
        return 0
    return sum(source_shape(spec, index, k).channels for k in range(slot))


def read_rows(window: tuple[int, int, int], n_out: int, n_in: int) -> np.ndarray:
    """[n_in + 1]: how many of the first r input rows some window of an axis reads
    (`window`: kernel, stride, padding). Every row, unless the stride is above the kernel
    (a residual block's 1x1, stride-2 projection skips every other row)."""
    k, s, p = window
    read = np.zeros(n_in, dtype=bool)
    starts = np.arange(n_out) * s - p
    for offset in range(k):
        rows = starts + offset
        read[rows[(rows >= 0) & (rows < n_in)]] = True
    return np.concatenate([[0], np.cumsum(read)])


def needed_boxes(spec: ModelSpec, index: int, boxes: np.ndarray, slot: int = 0) -> np.ndarray:
    """For reader blocks of layer `index` (boxes [B, 6]), the box of input `slot`'s units
    each one reads (the rows and columns its windows span: where a stride skips rows, the
    span holds rows no window reads, `read_rows`)."""
    src = source_shape(spec, index, slot)
    layer = spec.layers[index]
    n = len(boxes)
    if layer.kind == "dense":
        full = np.array([0, src.channels, 0, src.height, 0, src.width], dtype=np.int64)
        return np.broadcast_to(full, (n, 6)).copy()
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    need = np.empty((n, 6), dtype=np.int64)
    if layer.kind in CHANNELWISE:
        offset = channel_offset(spec, index, slot)
        need[:, 0:2] = np.clip(boxes[:, 0:2] - offset, 0, src.channels)
    else:
        need[:, 0], need[:, 1] = 0, src.channels
    need[:, 2] = np.clip(boxes[:, 2] * sh - ph, 0, src.height)
    need[:, 3] = np.clip((boxes[:, 3] - 1) * sh - ph + kh, 0, src.height)
    need[:, 4] = np.clip(boxes[:, 4] * sw - pw, 0, src.width)
    need[:, 5] = np.clip((boxes[:, 5] - 1) * sw - pw + kw, 0, src.width)
    return need


def read_edges(
    spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, boxes: np.ndarray, slot: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reader id, source id, units read) for every block pair where the reader reads the
    source through its input `slot`: readers ascending, each one's sources ascending. A
    window is a product of ranges of channels, rows and columns, so a pair's units are the
    product of three overlaps: the pairs are grown one dimension at a time, each partial pair
    repeated once per band of the next dimension it reads (no division: these arrays are the
    size of the edges). Pairs whose overlap holds only rows no window reads are dropped."""
    rb = boxes[reader.first : reader.first + reader.count]
    dims = _windows(spec, reader, source, rb, slot)
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
    if not units.all():  # a stride above the kernel: some bands hold no row read
        keep = units > 0
        parent, sid, units = parent[keep], sid[keep], units[keep]
    return parent + reader.first, sid + source.first, units


def edge_count(
    spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, boxes: np.ndarray, slot: int = 0
) -> int:
    """How many read edges `read_edges` would give, at most (computed per reader block, not
    per edge: cheap enough to decide whether a graph fits in memory before building it)."""
    rb = boxes[reader.first : reader.first + reader.count]
    counts = [d[2] for d in _windows(spec, reader, source, rb, slot)]
    return int((counts[0] * counts[1] * counts[2]).sum())


def _windows(
    spec: ModelSpec, reader: LayerBlocks, source: LayerBlocks, rb: np.ndarray, slot: int
) -> list:
    """Per dimension (channels, rows, columns) of the source: its band count, and for each
    reader block the first band it reads, how many, the rows of each band it reads (flat)
    and where each reader's counts start."""
    need = needed_boxes(spec, reader.index, rb, slot)
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, reader.index)
    out, src = spec.shapes[reader.index], source.shape
    dense = spec.layers[reader.index].kind == "dense"
    prefixes = (
        np.arange(src.channels + 1),
        np.arange(src.height + 1) if dense else read_rows((kh, sh, ph), out.height, src.height),
        np.arange(src.width + 1) if dense else read_rows((kw, sw, pw), out.width, src.width),
    )
    dims = []
    for col, bounds, prefix in zip(
        (0, 2, 4), (source.cbounds, source.ybounds, source.xbounds), prefixes, strict=True
    ):
        first, end = _range_of(bounds, need[:, col], need[:, col + 1])
        count = end - first
        inside, at = _band_overlaps(bounds, need[:, col], need[:, col + 1], first, count, prefix)
        dims.append((len(bounds) - 1, first, count, inside, at))
    return dims


def symmetric_csr(
    rd: np.ndarray,
    sr: np.ndarray,
    wt: np.ndarray,
    layers: tuple[LayerBlocks, ...],
    sources: list[tuple[int, ...]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric CSR (xadj, adjncy, adjwgt; int64, what METIS reads) of the read edges
    (`rd` ascending, each reader's sources ascending; `sources[i]`: the layers layer i
    reads), each row's neighbours ascending: its sources (lower ids: earlier layers), then
    its readers (later layers).

    A row's first slots hold its sources, the rest its readers (`forward` marks which). One
    reader layer's edges fill the source slots of that layer's rows, in edge order; the
    reader slots of a layer's rows are filled from the edges of every layer that reads it,
    reader layers ascending, in a stable sort of the sources (radix: a layer's block
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
    cuts = np.searchsorted(rd, [lb.first for lb in layers] + [vertices])
    for reader in layers[1:]:
        at = slice(cuts[reader.index], cuts[reader.index + 1])
        rows = slice(xadj[reader.first], xadj[reader.first + reader.count])
        into = forward[rows]
        adjncy[rows][into], adjwgt[rows][into] = sr[at], wt[at]
    for source in layers[:-1]:
        readers, sent, weight = [], [], []
        for i in (i for i in range(source.index + 1, len(layers)) if source.index in sources[i]):
            at = slice(cuts[i], cuts[i + 1])
            mine = slice(None)
            if len(sources[i]) > 1:  # the reader layer's edges from this source only
                mine = (sr[at] >= source.first) & (sr[at] < source.first + source.count)
            readers.append(rd[at][mine])
            sent.append(sr[at][mine])
            weight.append(wt[at][mine])
        if not readers:
            continue
        local = (sent[0] if len(sent) == 1 else np.concatenate(sent)) - source.first
        order = np.argsort(
            local.astype(np.uint16 if source.count <= 1 << 16 else np.int64), kind="stable"
        )
        del local
        rows = slice(xadj[source.first], xadj[source.first + source.count])
        into = ~forward[rows]
        adjncy[rows][into] = (readers[0] if len(readers) == 1 else np.concatenate(readers))[order]
        adjwgt[rows][into] = (weight[0] if len(weight) == 1 else np.concatenate(weight))[order]
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


def _band_overlaps(
    bounds: np.ndarray, lo, hi, first, count, prefix: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each reader i and each of its `count[i]` bands from `first[i]`: how many of the
    band's rows in the reader's window [lo[i], hi[i]) some window reads (`prefix`, the
    running count of read rows; flat), and where each reader's values start."""
    i, j = _expand(count)
    band = first[i] + j
    top = np.minimum(hi[i], bounds[band + 1])
    bottom = np.maximum(lo[i], bounds[band])
    inside = prefix[np.maximum(top, bottom)] - prefix[bottom]
    return inside, (np.cumsum(count) - count)
