"""Which outputs of a conv layer torch's own convolution computes: a worker's owned positions
of a channel group cut into rectangles of the plane (`plane_rectangles`), each run as one
convolution over the input box it reads; the positions no rectangle of MIN_CONVOLVED holds (an
irregular cut's edges) multiply gathered patches instead (`netpart.runtime.slices.ConvSlice`).
`convolved_units` counts, per conv layer and worker of a plan, the outputs on the first path:
the cost model prices the two paths apart by it, and the plan's report states each conv
layer's share.
"""

from __future__ import annotations

import itertools

import numpy as np

from netpart.partition.graph import UnitGraph

__all__ = ["MIN_CONVOLVED", "convolved_units", "plane_rectangles"]

MIN_CONVOLVED = 16  # output positions a rectangle needs to run as a convolution of its own


def plane_rectangles(
    positions: np.ndarray, width: int, least: int = MIN_CONVOLVED
) -> tuple[list[tuple[int, int, int, int]], np.ndarray]:
    """Sorted output positions of a plane `width` wide cut into rectangles (y0, y1, x0, x1)
    of at least `least` positions: each row's runs of columns, merged down the rows while a
    run keeps its columns; and the indices (into `positions`) of the positions left over."""
    if len(positions) == 0:
        return [], np.zeros(0, dtype=np.int64)
    y, x = np.divmod(positions, width)
    new = np.ones(len(positions), dtype=bool)  # a row segment starts here
    new[1:] = (y[1:] != y[:-1]) | (x[1:] != x[:-1] + 1)
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(positions))
    seg = np.stack([y[starts], x[starts], x[ends - 1] + 1], axis=1)  # [S, (y, x0, x1)]
    by = np.lexsort((seg[:, 0], seg[:, 2], seg[:, 1]))  # columns, then row
    seg, first = seg[by], starts[by]
    cut = np.ones(len(seg), dtype=bool)  # a rectangle starts here
    cut[1:] = (seg[1:, 1:] != seg[:-1, 1:]).any(axis=1) | (seg[1:, 0] != seg[:-1, 0] + 1)
    bounds = np.append(np.flatnonzero(cut), len(seg))
    rects, kept = [], np.zeros(len(positions), dtype=bool)
    for a, b in itertools.pairwise(bounds.tolist()):  # a loop over rectangles, not units
        y0, x0, x1 = (int(v) for v in seg[a])
        y1 = int(seg[b - 1, 0]) + 1
        if (y1 - y0) * (x1 - x0) >= least:
            rects.append((y0, y1, x0, x1))
            for i in range(a, b):  # its rows' segments
                kept[first[i] : first[i] + (x1 - x0)] = True
    return rects, np.flatnonzero(~kept)


def convolved_units(graph: UnitGraph, node_map: np.ndarray, workers: int) -> np.ndarray:
    """[L, P]: per conv layer and worker, how many of its owned outputs torch's convolution
    computes under `node_map` (0 for other kinds): each worker's positions of each channel
    group, cut as its slice cuts them."""
    done = np.zeros((len(graph.layers), workers))
    for i, lb in enumerate(graph.layers):
        if lb.kind != "conv":
            continue
        owners = node_map[lb.ids].reshape(lb.nc, lb.ny, lb.nx)
        heights, widths = np.diff(lb.ybounds), np.diff(lb.xbounds)
        plane = np.repeat(np.repeat(owners, heights, axis=1), widths, axis=2)  # [groups, H, W]
        channels = np.diff(lb.cbounds)
        for g in range(lb.nc):
            flat = plane[g].ravel()
            for w in np.unique(flat):  # a loop over workers, not units
                rects, _ = plane_rectangles(np.flatnonzero(flat == w), lb.shape.width)
                done[i, w] += channels[g] * sum((y1 - y0) * (x1 - x0) for y0, y1, x0, x1 in rects)
    return done
