"""Exact halo traffic of an assignment, and the lower bound it is compared with.

Traffic is counted at unit level, as the runtime sends it: in layer l's forward pass, worker s
sends worker d each unit of layer l's sources (the layer below in a chain) that s owns and that
some unit owned by d reads, once, however many of d's units read it. The backward pass sends
the same number of gradient values the other way. Units are activation values per example. In
a layer graph each reader layer's traffic is counted for it: a unit two layers of one worker
read (a residual block's input, read by its first conv and by the add) counts for both; a layer
reading one layer twice (x + x, a concat of x and x) receives each unit once.

Lower bound per layer, for q workers sharing it (a plan reports it for the q it uses):
dense readers all-gather their input, (q-1)*n; a merge or a batch norm reads pointwise, and
placed with its sources sends nothing (bound 0); spatial readers need at least the halo of the
best regular tiling of their output into q tiles (channel groups, each cut into row bands of
near-equal tile counts), each input unit owned by one of the tiles that read it:
sum_t |input read by t| - |input read by anyone|. A group with more tiles than output
positions (a small layer on many workers) splits some positions' channels: each tile past
one per position reads at least the smallest single position's window again.
"""

from __future__ import annotations

import functools

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks
from netpart.partition.graph import UnitGraph
from netpart.partition.reads import (
    CHANNELWISE,
    channel_offset,
    needed_boxes,
    read_pairs,
    read_rows,
    read_window,
    source_shape,
)

__all__ = ["coverage", "layer_lower_bounds", "layer_traffic", "needed_units", "workers_per_layer"]


def layer_traffic(
    graph: UnitGraph, node_map: np.ndarray, workers: int, readers: list[int] | None = None
) -> np.ndarray:
    """T[l, s, d]: units of layer l's sources sent from worker s to worker d for layer l
    (0 for what layers read of the network's input); with `readers`, only those layers' (the
    others stay 0)."""
    spec = graph.spec
    out = np.zeros((len(graph.layers), workers, workers), dtype=np.int64)
    chosen = None if readers is None else set(readers)
    done = set()
    for index, slot, source in read_pairs(spec):
        if chosen is not None and index not in chosen:
            continue
        if (index, source) in done:
            continue  # x + x: the same units, sent once
        done.add((index, source))
        slots = [k for k, s in enumerate(spec.sources(index)) if s == source]
        if spec.layers[index].kind == "dense":
            reader = graph.layers[index]
            t = _dense_traffic(graph, reader, graph.layers[source], node_map, workers)
        elif len(slots) > 1 and spec.layers[index].kind == "concat":
            t = _union_traffic(graph, index, node_map, workers, slots)
        else:
            t = _spatial_traffic(graph, index, node_map, workers, slot)
        np.fill_diagonal(t, 0)
        out[index] += t
    return out


def _dense_traffic(
    graph: UnitGraph, reader: LayerBlocks, source: LayerBlocks, node_map: np.ndarray, workers: int
) -> np.ndarray:
    src_ids = source.ids
    owned = np.bincount(node_map[src_ids], weights=graph.units[src_ids], minlength=workers)
    takes_part = np.bincount(node_map[reader.ids], minlength=workers) > 0
    return np.outer(owned.astype(np.int64), takes_part.astype(np.int64))


def coverage(
    graph: UnitGraph, index: int, node_map: np.ndarray, workers: int, slot: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Which units of input `slot` of windowed or pointwise layer `index` each worker reads:
    (covered, slab_bounds).

    covered[w, j, y, x] is True when worker w's blocks of the layer read position (y, x) of
    the input in channel slab j = [slab_bounds[j], slab_bounds[j+1]) (the input's channels):
    the reader's channel groups for a channel-wise reader (pool, merge, batch norm), else one
    slab of all channels. Computed with difference arrays over every reader block's
    (rectangular) window at once; rows and columns no window reads (a stride above the
    kernel) are left out.
    """
    spec = graph.spec
    reader = graph.layers[index]
    source_shape_ = source_shape(spec, index, slot)
    rb = graph.box[reader.ids]
    need = needed_boxes(spec, index, rb, slot)
    h, w = source_shape_.height, source_shape_.width
    if spec.layers[index].kind in CHANNELWISE:
        slab_of = np.searchsorted(reader.cbounds, rb[:, 0], side="right") - 1
        offset = channel_offset(spec, index, slot)
        slab_bounds = np.clip(reader.cbounds - offset, 0, source_shape_.channels)
    else:
        slab_of = np.zeros(len(rb), dtype=np.int64)
        slab_bounds = np.array([0, source_shape_.channels])
    dst = node_map[reader.ids]
    diff = np.zeros((workers, len(slab_bounds) - 1, h + 1, w + 1), dtype=np.int32)
    for ys, xs, sign in ((2, 4, 1), (2, 5, -1), (3, 4, -1), (3, 5, 1)):
        np.add.at(diff, (dst, slab_of, need[:, ys], need[:, xs]), sign)
    covered = diff.cumsum(axis=2).cumsum(axis=3)[:, :, :h, :w] > 0
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    out = spec.shapes[index]
    rows = np.diff(read_rows((kh, sh, ph), out.height, h)) > 0
    cols = np.diff(read_rows((kw, sw, pw), out.width, w)) > 0
    if not (rows.all() and cols.all()):
        covered &= rows[:, None] & cols[None, :]
    return covered, slab_bounds


def _spatial_traffic(
    graph: UnitGraph, index: int, node_map: np.ndarray, workers: int, slot: int = 0
) -> np.ndarray:
    """Counts per (owner, reader) of the covered units of input `slot`."""
    covered, slab_bounds = coverage(graph, index, node_map, workers, slot)
    source = graph.layers[graph.spec.sources(index)[slot]]
    h, w = source.shape.height, source.shape.width
    owners = source.owner_grid(node_map)  # [G, H, W]
    cb = source.cbounds
    t = np.zeros((workers, workers), dtype=np.float64)
    for j in range(len(slab_bounds) - 1):
        lo, hi = slab_bounds[j], slab_bounds[j + 1]
        overlap = np.clip(np.minimum(cb[1:], hi) - np.maximum(cb[:-1], lo), 0, None)
        groups = np.nonzero(overlap)[0]
        if len(groups) == 0:  # a concat's reader channels that are another input's
            continue
        # m[pos, s] = channels at pos (within this slab) that worker s owns.
        idx = np.arange(h * w)[None, :] * workers + owners[groups].reshape(len(groups), -1)
        weights = np.broadcast_to(overlap[groups][:, None], idx.shape)
        m = np.bincount(idx.ravel(), weights=weights.ravel(), minlength=h * w * workers)
        t += covered[:, j].reshape(workers, -1).astype(np.float64) @ m.reshape(h * w, workers)
    return np.rint(t.T).astype(np.int64)  # [s, d]


def needed_units(
    graph: UnitGraph, index: int, node_map: np.ndarray, workers: int, slot: int = 0
) -> np.ndarray:
    """[workers, units of input `slot`'s layer]: which of them each worker's blocks of layer
    `index` read (`coverage`, its slabs expanded to channels)."""
    source = graph.layers[graph.spec.sources(index)[slot]]
    n = source.shape.size
    covered, slab_bounds = coverage(graph, index, node_map, workers, slot)
    expanded = np.repeat(covered, np.diff(slab_bounds), axis=1).reshape(workers, -1)
    if expanded.shape[1] == n:  # every channel of the input (a chain's layer)
        return expanded
    out = np.zeros((workers, n), dtype=bool)
    start = slab_bounds[0] * (n // source.shape.channels)
    out[:, start : start + expanded.shape[1]] = expanded
    return out


def _union_traffic(
    graph: UnitGraph, index: int, node_map: np.ndarray, workers: int, slots: list[int]
) -> np.ndarray:
    """Counts per (owner, reader) of the units of one source that several inputs of layer
    `index` read (a concat of one layer twice), each unit once per reader."""
    source = graph.layers[graph.spec.sources(index)[slots[0]]]
    needed = np.zeros((workers, source.shape.size), dtype=bool)
    for slot in slots:
        needed |= needed_units(graph, index, node_map, workers, slot)
    owner = np.repeat(source.owner_grid(node_map), np.diff(source.cbounds), axis=0).ravel()
    t = np.stack([np.bincount(owner[needed[d]], minlength=workers) for d in range(workers)])
    return t.T.astype(np.int64)  # [s, d]


def workers_per_layer(graph: UnitGraph, workers: int) -> np.ndarray:
    """q_l = min(workers, blocks of layer l): how many workers a balanced plan spreads it over."""
    return np.array([min(workers, lb.count) for lb in graph.layers], dtype=np.int64)


def _covered(a: np.ndarray, b: np.ndarray, window: tuple[int, int, int], n_in: int) -> np.ndarray:
    """Input rows read by output rows [a, b) through one axis's windows (kernel, stride,
    padding), clipped to [0, n_in): the span of their windows, less the rows in it no window
    reads (a stride above the kernel)."""
    k, s, p = window
    if s <= k:  # the windows of a contiguous range form one interval: all of it is read
        return np.maximum(0, np.minimum((b - 1) * s - p + k, n_in) - np.maximum(a * s - p, 0))
    lo = np.clip(a * s - p, 0, n_in)
    hi = np.clip((b - 1) * s - p + k, lo, n_in)
    prefix = read_rows(window, int(np.max(b, initial=1)), n_in)
    return prefix[hi] - prefix[lo]


def _tiling_halo(
    h: int, w: int, parts: int, wy: tuple[int, int, int], wx: tuple[int, int, int], n_in: tuple
) -> float:
    """Smallest sum_t |N(t)| - |N(all)| (positions) over brick tilings of h x w into `parts`
    (`wy`, `wx`: each axis's window; `n_in`: the input's height and width)."""
    h_in, w_in = n_in
    full = _covered(np.array([0]), np.array([h]), wy, h_in)[0]
    full *= _covered(np.array([0]), np.array([w]), wx, w_in)[0]
    best = np.inf
    for rows, cols, n_r, n_c, wr, wc in ((h, w, h_in, w_in, wy, wx), (w, h, w_in, h_in, wx, wy)):

        def row_cost(c: int, cols: int = cols, n_c: int = n_c, wc: tuple = wc) -> int:
            xe = (np.arange(c + 1) * cols) // c
            return int(_covered(xe[:-1], xe[1:], wc, n_c).sum())

        for bands in range(1, min(parts, rows) + 1):
            per_band = np.full(bands, parts // bands) + (np.arange(bands) < parts % bands)
            if per_band.max() > cols:
                continue
            # Band heights proportional to their tile counts, integer, each >= 1.
            edges = np.rint(np.concatenate([[0], np.cumsum(per_band)]) * rows / parts)
            edges = edges.astype(np.int64)
            if np.any(np.diff(edges) < 1):
                continue
            band_rows = _covered(edges[:-1], edges[1:], wr, n_r)
            cost = {c: row_cost(c) for c in set(per_band.tolist())}
            total = int((band_rows * np.array([cost[c] for c in per_band.tolist()])).sum())
            best = min(best, total - full)
    return float(best)


def _compositions(parts: int, groups: int) -> list[list[int]]:
    """Tile counts per channel group: the even split and the most uneven one."""
    even = [parts // groups + (i < parts % groups) for i in range(groups)]
    uneven = [1] * (groups - 1) + [parts - groups + 1]
    return [even, uneven]


def layer_lower_bounds(spec: ModelSpec, q: np.ndarray) -> np.ndarray:
    """Lower bound of each layer's forward traffic (units per example) with q[l] workers.

    Spatial layers: the best of tilings that cut the output channels into G groups and tile
    group i into m_i near-equal brick tiles (sum m_i = q). A channel-wise reader (pool) pays
    halo(m_i) per channel of group i, and the channels go where the halo is smallest; other
    readers re-read all input channels in every group: Cin * (sum_i halo(m_i) + (G-1) * |N|).
    """
    return np.array(_bounds(spec, tuple(int(x) for x in q)), dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _bounds(spec: ModelSpec, q: tuple[int, ...]) -> tuple[int, ...]:
    """layer_lower_bounds, memoised: `auto` evaluates several plans of one model and P."""
    out = [0] * len(spec.layers)
    for i in range(1, len(spec.layers)):
        parts, layer = q[i], spec.layers[i]
        if parts <= 1 or layer.kind in ("add", "concat", "batchnorm"):
            continue
        if layer.kind == "dense":
            out[i] = sum((parts - 1) * s.size for s in _read_shapes(spec, i))
        else:
            out[i] = _spatial_bound(spec, i, parts) if spec.sources(i)[0] >= 0 else 0
    return tuple(out)


def _read_shapes(spec: ModelSpec, index: int) -> list:
    """The shapes of the layers layer `index` reads (not the network's input: data)."""
    return [spec.shapes[s] for s in spec.sources(index) if s >= 0]


def _spatial_bound(spec: ModelSpec, index: int, parts: int) -> int:
    layer, src, o = spec.layers[index], spec.input_shape(index), spec.shapes[index]
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    wy, wx = (kh, sh, ph), (kw, sw, pw)
    n_all = _covered(np.array([0]), np.array([o.height]), wy, src.height)[0]
    n_all *= _covered(np.array([0]), np.array([o.width]), wx, src.width)[0]
    positions = o.height * o.width
    options = [
        tiles
        for groups in range(1, min(parts, o.channels) + 1)
        for tiles in _compositions(parts, groups)
        if layer.kind != "pool" or max(tiles) <= positions
    ]
    needed = sorted({m for tiles in options for m in tiles})
    n_in = (src.height, src.width)
    halo = {m: _tiling_halo(o.height, o.width, min(m, positions), wy, wx, n_in) for m in needed}
    if any(m > positions for m in needed):
        # More tiles than positions: some positions' channels are split between tiles, and
        # each tile past one per position reads at least the smallest window again.
        smallest = _covered(np.arange(o.height), np.arange(1, o.height + 1), wy, src.height).min()
        smallest *= _covered(np.arange(o.width), np.arange(1, o.width + 1), wx, src.width).min()
        for m in needed:
            halo[m] += max(m - positions, 0) * int(smallest)
    best = np.inf
    for tiles in options:
        costs = sorted(halo[m] for m in tiles)
        if layer.kind == "pool":
            cost = costs[0] * (o.channels - len(tiles) + 1) + sum(costs[1:])
        else:
            cost = src.channels * (sum(costs) + (len(tiles) - 1) * n_all)
        best = min(best, cost)
    return int(best) if np.isfinite(best) else 0
