"""The layer-aligned graph: the image plane, cut once and carried through every spatial layer.

DistBelief partitions a locally connected model by regions of the image: a worker owns the
units of every layer that fall in its region. `build_plane` makes that graph: vertices are
cells of the plane (the finest layer's positions), each carrying one weight per spatial layer
(that layer's FLOPs over the cell, every layer stretched over the whole plane) as METIS
balance constraints; 4-neighbour edges are weighted by the halo a cut between two cells costs,
summed over the spatial readers. `blocks_from_plane` gives every block of the unit graph the
owner of its region; where a block's region spans several owners (layers with fewer positions
than workers), its channel groups are shared among them in proportion to their area.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks
from netpart.partition.graph import UnitGraph, flops_per_unit
from netpart.partition.reads import read_window

__all__ = ["Plane", "blocks_from_plane", "build_plane", "layer_weights", "plane_shape"]

MAX_CELLS = 16384  # planes finer than this are coarsened (cells of several input pixels)


@dataclass(frozen=True, eq=False)
class Plane:
    """A grid of ny x nx cells over the image plane; vertex c = row * nx + column.

    Invariants: `vwgt` is [cells, constraints], every entry positive; the CSR
    adjacency (`xadj`, `adjncy`, `adjwgt`) joins 4-neighbours, symmetric with equal weights.
    """

    ny: int
    nx: int
    vwgt: np.ndarray
    xadj: np.ndarray
    adjncy: np.ndarray
    adjwgt: np.ndarray

    @property
    def cells(self) -> int:
        return self.ny * self.nx


def _overlap(lo: np.ndarray, hi: np.ndarray, scale: float, n: int) -> np.ndarray:
    """[len(lo), n]: length of [lo_i scale, hi_i scale) inside cell j = [j, j + 1)."""
    edges = np.arange(n + 1, dtype=np.float64)
    lo, hi = np.asarray(lo)[:, None] * scale, np.asarray(hi)[:, None] * scale
    return np.clip(np.minimum(hi, edges[None, 1:]) - np.maximum(lo, edges[None, :-1]), 0, None)


def _grid_adjacency(ny: int, nx: int, weight: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric CSR of the ny x nx 4-neighbour grid, every edge weighing `weight`."""
    ids = np.arange(ny * nx).reshape(ny, nx)
    pairs = [(ids[:, :-1].ravel(), ids[:, 1:].ravel()), (ids[:-1, :].ravel(), ids[1:, :].ravel())]
    u = np.concatenate([p[0] for p in pairs] + [p[1] for p in pairs])
    v = np.concatenate([p[1] for p in pairs] + [p[0] for p in pairs])
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    xadj = np.zeros(ny * nx + 1, dtype=np.int64)
    np.cumsum(np.bincount(u, minlength=ny * nx), out=xadj[1:])
    return xadj, v.astype(np.int64), np.full(len(v), max(1, weight), dtype=np.int64)


def _halo_per_cell(spec: ModelSpec, rows: int) -> float:
    """Values a straight cut one cell long makes the spatial readers exchange.

    A reader with window (k, s) makes its two sides share k - s rows of its input, each
    carrying that layer's channels; one cell is H_{l-1} / rows positions of its input. A
    rectangular window shares kh - sh rows across one cut and kw - sw columns across the
    other: the mean of the two (every edge of the grid weighs the same).
    """
    total = 0.0
    for i in range(1, len(spec.layers)):
        if spec.is_flat(i) or spec.sources(i)[0] < 0:  # no halo: flat, or reads the input
            continue
        (kh, kw), (sh, sw), _ = read_window(spec, i)
        src = spec.input_shape(i)
        total += src.channels * (max(kh - sh, 0) + max(kw - sw, 0)) / 2 * src.height / rows
    return total


def _distinct(columns: list[np.ndarray]) -> np.ndarray:
    """The columns as [cells, n], dropping any proportional to one kept before it."""
    kept: list[np.ndarray] = []
    for c in columns:
        unit = c / c.sum()
        if not any(np.abs(unit - k).max() <= 1e-3 * unit.max() for k in kept):
            kept.append(unit)
    return np.stack(kept, axis=1)


def plane_shape(spec: ModelSpec, max_cells: int = MAX_CELLS) -> tuple[int, int]:
    """(rows, columns) of the plane: the finest spatial layer's, fewer beyond `max_cells`."""
    spatial = [i for i in range(len(spec.layers)) if not spec.is_flat(i)]
    rows = max(spec.shapes[i].height for i in spatial)
    cols = max(spec.shapes[i].width for i in spatial)
    scale = min(1.0, math.sqrt(max_cells / (rows * cols)))
    return max(1, int(rows * scale)), max(1, int(cols * scale))


def layer_weights(spec: ModelSpec, ny: int, nx: int) -> np.ndarray:
    """[ny * nx, spatial layers]: each layer's FLOPs per cell, by the area its positions cover.

    Layer l's position (y, x) covers cells [y ny / H_l, (y+1) ny / H_l) x [x nx / W_l, ...),
    so every layer spans the whole plane; each column sums to its layer's FLOPs.
    """
    out = []
    for i in range(len(spec.layers)):
        if spec.is_flat(i):
            continue
        shape = spec.shapes[i]
        ry = _overlap(
            np.arange(shape.height), np.arange(1, shape.height + 1), ny / shape.height, ny
        )
        rx = _overlap(np.arange(shape.width), np.arange(1, shape.width + 1), nx / shape.width, nx)
        per_cell = (
            shape.channels * float(flops_per_unit(spec, i)) / (ny / shape.height * nx / shape.width)
        )
        out.append(np.outer(ry.sum(axis=0), rx.sum(axis=0)).ravel() * per_cell)
    return np.stack(out, axis=1)


def build_plane(spec: ModelSpec, max_cells: int = MAX_CELLS) -> Plane:
    """The layer-aligned graph of `spec`'s leading spatial layers.

    Vertex weights are `layer_weights`, one balance constraint per layer, scaled to integers;
    constraints proportional to one another (layers of uniform density over the plane, as in
    every zoo model) are kept once: METIS balances them alike and partitions worse with more.
    """
    ny, nx = plane_shape(spec, max_cells)
    w = _distinct(list(layer_weights(spec, ny, nx).T))
    w = np.maximum(1, np.rint(w * (1e6 / w.max(axis=0)))).astype(np.int64)
    halo = _halo_per_cell(spec, ny)
    xadj, adjncy, adjwgt = _grid_adjacency(ny, nx, round(halo))
    return Plane(ny, nx, w, xadj, adjncy, adjwgt)


def _shares(lb: LayerBlocks, plane: Plane, onehot: np.ndarray) -> np.ndarray:
    """[ny, nx, P]: plane area of each block column (row band x column band) per owner."""
    fy, fx = plane.ny / lb.shape.height, plane.nx / lb.shape.width
    by = _overlap(lb.ybounds[:-1], lb.ybounds[1:], fy, plane.ny)  # [ny, R]
    bx = _overlap(lb.xbounds[:-1], lb.xbounds[1:], fx, plane.nx)  # [nx, Q]
    rows = np.tensordot(by, onehot, axes=(1, 0))  # [ny, Q, P]
    return np.einsum("yqp,xq->yxp", rows, bx)


def blocks_from_plane(
    graph: UnitGraph, plane: Plane, cell_owner: np.ndarray, workers: int, out: np.ndarray
) -> None:
    """Write into `out` (block -> worker) the owner of every spatial block's region.

    A block with one channel group goes to the owner of most of its region; a position's
    channel groups are shared among its region's owners in proportion to their area (in worker
    order, each group to the owner its midpoint falls to).
    """
    onehot = np.zeros((plane.cells, workers), dtype=np.float64)
    onehot[np.arange(plane.cells), cell_owner] = 1.0
    onehot = onehot.reshape(plane.ny, plane.nx, workers)
    for lb in graph.layers:
        if graph.spec.is_flat(lb.index):
            continue
        share = _shares(lb, plane, onehot).reshape(lb.ny * lb.nx, workers)
        if lb.nc == 1:
            owner = share.argmax(axis=1)[None, :]
        else:
            cum = np.cumsum(share, axis=1) / share.sum(axis=1, keepdims=True)
            mid = (np.arange(lb.nc) + 0.5) / lb.nc  # [nc]
            owner = (cum[None, :, :] <= mid[:, None, None]).sum(axis=2)  # [nc, ny*nx]
            owner = np.minimum(owner, workers - 1)
        out[lb.ids] = np.broadcast_to(owner, (lb.nc, lb.ny * lb.nx)).ravel()
