"""Per-layer balance repairs shared by the partitioners. Pure functions over a UnitGraph.

`quantile_cut` splits an ordered sequence by weight shares, `rebalance` moves blocks until
every layer is within its tolerance, `follow_pools` gives a pool's input blocks the owner of
the pool block that reads them where that lowers the volume.
"""

from __future__ import annotations

import numpy as np

from netpart.partition.graph import UnitGraph, aligned_pool, narrow
from netpart.partition.volume import layer_traffic

__all__ = ["follow_pools", "quantile_cut", "rebalance"]


def quantile_cut(weights: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Part of each item (in the given order) so that part j gets ~shares[j] of the weight.

    An item goes to the part its weight midpoint falls in: every part is within one item's
    weight of its share.
    """
    cum = np.cumsum(weights, dtype=np.float64)
    mid = (cum - weights / 2.0) / cum[-1]
    return np.minimum(np.searchsorted(np.cumsum(shares), mid, side="right"), len(shares) - 1)


def _connection(graph: UnitGraph, layer: int, node_map: np.ndarray, workers: int) -> np.ndarray:
    """[blocks of `layer`, workers]: the edge weight from each block of the layer to the
    blocks each worker owns — its sources and its readers, from the read edges of the layer
    and of the layers that read it (no adjacency needed)."""
    reader, read, units = graph.reads
    cuts, lb = graph.read_cuts, graph.layers[layer]
    conn = np.zeros(lb.count * workers)
    sides = [(cuts[layer], cuts[layer + 1], reader, read)]  # the layer reads its sources
    spec = graph.spec
    for above in range(layer + 1, len(graph.layers)):
        if layer in spec.sources(above):  # it is read above
            sides.append((cuts[above], cuts[above + 1], read, reader))
    small = narrow(node_map)
    wide = np.int32 if lb.count * workers < 2**31 else np.int64
    for a, b, mine, other in sides:
        if a == b:
            continue
        ours = slice(a, b)
        if mine is read and len(spec.sources(int(graph.layer_of[reader[a]]))) > 1:
            ours = a + np.flatnonzero((read[a:b] >= lb.first) & (read[a:b] < lb.first + lb.count))
        key = (mine[ours].astype(wide) - lb.first) * workers + small[other[ours]]
        conn += np.bincount(key, weights=units[ours], minlength=lb.count * workers)
    return conn.reshape(lb.count, workers)


def rebalance(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    imbalance: float,
    share: np.ndarray | None = None,
) -> np.ndarray:
    """Repair per-layer balance: METIS may miss its tolerance (always on tiny graphs).

    In each layer with at least `workers` blocks, while the most loaded worker (relative to its
    share) exceeds (1 + imbalance) x its fair load, move one of its blocks to another worker:
    the move that gains the most edge weight (into the receiver minus into the sender) among
    those that leave the receiver within tolerance, else among those that help at all.
    """
    node_map = node_map.copy()
    share = np.full(workers, 1.0 / workers) if share is None else share
    for lb in graph.layers:
        if lb.count < workers:
            continue
        ids = lb.ids
        w = graph.flops[ids].astype(np.float64)
        fair = w.sum() * share
        loads = np.bincount(node_map[ids], weights=w, minlength=workers)
        conn = None  # the layer's blocks' edge weight to each worker: moves here leave it be
        for _ in range(lb.count):
            rel = loads / fair
            src = int(rel.argmax())
            if rel[src] <= 1.0 + imbalance:
                break
            mine = np.nonzero(node_map[ids] == src)[0]
            after = (loads[None, :] + w[mine, None]) / fair[None, :]  # receiver's load after
            if conn is None:
                conn = _connection(graph, lb.index, node_map, workers)
            gain = conn[mine] - conn[mine, src : src + 1]
            helps = after < rel[src]
            helps[:, src] = False
            within = helps & (after <= 1.0 + imbalance)
            allowed = within if within.any() else helps
            if not allowed.any():
                break
            c, dst = np.unravel_index(np.where(allowed, gain, -np.inf).argmax(), gain.shape)
            pick = int(ids[mine[c]])
            node_map[pick] = dst
            loads[src] -= graph.flops[pick]
            loads[dst] += graph.flops[pick]
    return node_map


def follow_pools(
    graph: UnitGraph, node_map: np.ndarray, workers: int, share: np.ndarray
) -> np.ndarray:
    """Give each block of a pool's input the owner of the pool block that reads it, so the pool
    exchanges nothing; blocks no pool window reads go to the least loaded workers. Kept for a
    layer only where it lowers the total volume (a followed layer may read more itself) and
    leaves it no worse balanced than it was or than the pool is. (Following layer i changes
    the traffic of layers i and i + 1 only: those two are counted.)"""
    spec = graph.spec
    for lb in reversed(graph.layers[:-1]):
        i = lb.index
        if spec.is_flat(i) or not aligned_pool(spec, i + 1) or spec.sources(i + 1) != (i,):
            continue
        pool, stride = graph.layers[i + 1], spec.layers[i + 1].stride
        b = graph.box[lb.ids]
        live = (b[:, 3] <= pool.shape.height * stride) & (b[:, 5] <= pool.shape.width * stride)
        gy = np.searchsorted(pool.ybounds, b[live, 2] // stride, side="right") - 1
        gx = np.searchsorted(pool.xbounds, b[live, 4] // stride, side="right") - 1
        gc = np.searchsorted(pool.cbounds, b[live, 0], side="right") - 1
        followed = node_map.copy()
        followed[lb.ids[live]] = node_map[pool.first + (gc * pool.ny + gy) * pool.nx + gx]
        w = graph.flops[lb.ids].astype(np.float64)
        loads = np.bincount(followed[lb.ids[live]], weights=w[live], minlength=workers) / share
        dead = np.nonzero(~live)[0]
        for j in dead[np.argsort(-w[dead], kind="stable")]:  # few: one band of rows/columns
            k = int(loads.argmin())
            followed[lb.ids[j]] = k
            loads[k] += w[j] / share[k]
        fair = w.sum()
        before = np.bincount(node_map[lb.ids], weights=w, minlength=workers) / share
        pool_w = graph.flops[pool.ids].astype(np.float64)
        pool_loads = np.bincount(node_map[pool.ids], weights=pool_w, minlength=workers) / share
        worst = max(before.max() / fair, pool_loads.max() / pool_w.sum())
        balanced = loads.max() / fair <= worst
        if not balanced:
            continue
        touched = [i, *(j for j in range(i + 1, len(graph.layers)) if i in spec.sources(j))]
        before = int(layer_traffic(graph, node_map, workers, touched).sum())
        if int(layer_traffic(graph, followed, workers, touched).sum()) < before:
            node_map = followed
    return node_map
