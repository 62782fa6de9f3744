"""Layers that share a block grid, stacked: the unit graph contracted so METIS cuts them alike.

A deep layer graph (a ResNet: a hundred layers and more, most of a stage on one grid) gives
METIS one balance constraint per layer, more than it balances well: it trades the cut for the
constraints and ends near an even cut in block order. Layers run in lockstep and a stage's
layers cover the same plane, so the cut that suits one suits the others: here the layers of
one grid (the same shape, channel groups, row and column bands) become one stack, a block of
each at the same place one vertex. A vertex weighs its stack's FLOPs at that place (one
constraint per stack), its size is its units, and an edge joins two vertices when any of their
blocks read one another (the units summed; reads inside one vertex, a merge reading its own
stack at the same place, vanish). A cut of the stacks gives every layer of a stack the same
cut, each balanced as the stack is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netpart.partition.graph import UnitGraph

__all__ = ["Stacks", "stack_graph"]


@dataclass(frozen=True, eq=False)
class Stacks:
    """The contracted graph: `of[v]` the vertex of block v, `vwgt` [vertices, grids] (a
    vertex's FLOPs in its grid's column: one constraint per grid), `vsize` its units, and
    the symmetric CSR adjacency (`xadj`, `adjncy`, `adjwgt`)."""

    of: np.ndarray
    vwgt: np.ndarray
    vsize: np.ndarray
    xadj: np.ndarray
    adjncy: np.ndarray
    adjwgt: np.ndarray


def stack_graph(graph: UnitGraph) -> Stacks:
    """Stack the layers of `graph` that share a block grid (`Stacks`)."""
    grids: dict[tuple, tuple[int, int]] = {}  # grid -> (stack, first vertex)
    first, column = [], []
    vertices = 0
    for lb in graph.layers:
        key = (lb.shape, tuple(lb.cbounds), tuple(lb.ybounds), tuple(lb.xbounds))
        if key not in grids:
            grids[key] = (len(grids), vertices)
            vertices += lb.count
        stack, start = grids[key]
        first.append(start)
        column.append(stack)
    first_of = np.asarray(first, dtype=np.int64)
    of = first_of[graph.layer_of] + (np.arange(graph.num_vertices) - _layer_first(graph))
    stacks = np.asarray(column, dtype=np.int64)[graph.layer_of]
    vwgt = np.zeros((vertices, len(grids)), dtype=np.int64)
    np.add.at(vwgt, (of, stacks), graph.flops)
    vsize = np.bincount(of, weights=graph.units, minlength=vertices).astype(np.int64)
    reader, read, units = graph.reads
    a, b = of[reader], of[read]
    keep = a != b
    u = np.concatenate([a[keep], b[keep]])
    v = np.concatenate([b[keep], a[keep]])
    w = np.concatenate([units[keep], units[keep]]).astype(np.int64)
    order = np.lexsort((v, u))
    u, v, w = u[order], v[order], w[order]
    first = np.ones(len(u), dtype=bool)
    first[1:] = (u[1:] != u[:-1]) | (v[1:] != v[:-1])
    starts = np.flatnonzero(first)
    u, v, w = u[starts], v[starts], np.add.reduceat(w, starts) if len(w) else w
    xadj = np.zeros(vertices + 1, dtype=np.int64)
    np.cumsum(np.bincount(u, minlength=vertices), out=xadj[1:])
    return Stacks(of, vwgt, vsize, xadj, v.astype(np.int64), w)


def _layer_first(graph: UnitGraph) -> np.ndarray:
    """[V]: the id of the first block of each block's layer."""
    firsts = np.array([lb.first for lb in graph.layers], dtype=np.int64)
    return firsts[graph.layer_of]
