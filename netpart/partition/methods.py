"""Partitioners: each maps a UnitGraph to a node map (block -> worker). Pure functions, no I/O.

`metis` balances every layer separately (one METIS constraint per layer: workers run layers in
lockstep, so balancing only total work serialises the model) and minimises communication
volume. `tiles` is the geometric alternative for image models: regular tiles cut at each
layer's weight quantiles, so every layer balances and receptive fields stay aligned.
The baselines are what one would do by hand:
`spatial` regular 2-D tiles, the same in every layer; `stripe` every layer cut evenly in block
order; `layers` contiguous layers per worker (pipeline); `round-robin`; `random`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from netpart.errors import PlanError
from netpart.partition.balance import follow_pools, quantile_cut, rebalance
from netpart.partition.graph import UnitGraph
from netpart.partition.metis import part_graph
from netpart.partition.plane import blocks_from_plane, build_plane
from netpart.partition.stacks import stack_graph

__all__ = ["ALIGNED", "METHODS", "METHOD_OPTIONS", "assign", "default_bands"]


def _metis(
    graph: UnitGraph,
    workers: int,
    seed: int,
    imbalance: float = 0.03,
    capacities: list[float] | None = None,
    algorithm: str = "recursive",
    objective: str | None = None,
    ncuts: int = 1,
    niter: int = 10,
) -> np.ndarray:
    """METIS with one balance constraint per layer, then a per-layer balance repair. On a
    layer graph, the layers of one block grid are stacked (`stacks`): one constraint each.

    `algorithm` "recursive" (default; edge-cut objective) or "kway" (objective "vol" by
    default, or "cut"). On the image models recursive bisection gives lower true volume and runs
    orders of magnitude faster at 64+ workers (docs/planning.md has the measurements). Layers with
    fewer blocks than workers cannot be balanced over all of them; they share one extra
    constraint so METIS spreads them over a subset instead of failing to balance.
    """
    if objective is None:
        objective = "cut" if algorithm == "recursive" else "vol"
    if graph.spec.is_chain:
        of = None
        adjacency = (graph.xadj, graph.adjncy, graph.adjwgt)
        vwgt, vsize = graph.vertex_weights(), graph.units
    else:  # a layer graph: the layers of one block grid cut alike (`stacks`)
        stacks = stack_graph(graph)
        of = stacks.of
        adjacency = (stacks.xadj, stacks.adjncy, stacks.adjwgt)
        vwgt, vsize = stacks.vwgt, stacks.vsize
    vwgt = _shared_small(vwgt, workers)
    ncon = vwgt.shape[1]
    tpwgts = None
    if capacities is not None:
        cap = np.asarray(capacities, dtype=np.float64)
        tpwgts = np.repeat((cap / cap.sum())[:, None], ncon, axis=1)
    ubvec = np.full(ncon, 1.0 + imbalance)
    parts = part_graph(
        *adjacency[:2],
        vwgt,
        workers,
        vsize=vsize,
        adjwgt=adjacency[2],
        tpwgts=tpwgts,
        ubvec=ubvec,
        algorithm=algorithm,
        objective=objective,
        seed=seed,
        ncuts=ncuts,
        niter=niter,
        symmetric=True,  # both directions of every read edge, by construction
    ).parts
    if of is not None:
        parts = parts[of]
    share = None if capacities is None else np.asarray(capacities, float) / np.sum(capacities)
    return rebalance(graph, parts, workers, imbalance, share)


def _shared_small(vwgt: np.ndarray, workers: int) -> np.ndarray:
    """The balance constraints (columns of `vwgt`), those with fewer weighted vertices than
    workers summed into one shared last column: such a layer cannot be balanced over every
    worker, and sharing lets METIS spread them over a subset instead of failing to balance."""
    small = (vwgt > 0).sum(axis=0) < workers
    if not small.any():
        return vwgt
    if small.all():
        return vwgt.sum(axis=1, keepdims=True)
    return np.concatenate([vwgt[:, ~small], vwgt[:, small].sum(axis=1, keepdims=True)], axis=1)


def _metis_aligned(
    graph: UnitGraph,
    workers: int,
    seed: int,
    imbalance: float = 0.03,
    capacities: list[float] | None = None,
    algorithm: str = "kway",
    objective: str | None = None,
    ncuts: int = 1,
    niter: int = 10,
) -> np.ndarray:
    """METIS on the layer-aligned graph (`plane.build_plane`): the image plane cut once, one
    balance constraint per spatial layer, each spatial block given its region's owner; dense
    layers cut evenly by FLOPs; then the per-layer balance repair and the pools' inputs follow
    the pools (as in `tiles`)."""
    share = np.full(workers, 1.0 / workers)
    if capacities is not None:
        share = np.asarray(capacities, dtype=np.float64) / np.sum(capacities)
    out = np.empty(graph.num_vertices, dtype=np.int64)
    spatial = [lb for lb in graph.layers if not graph.spec.is_flat(lb.index)]
    if spatial:
        plane = build_plane(graph.spec)
        ncon = plane.vwgt.shape[1]
        cell_owner = part_graph(
            plane.xadj,
            plane.adjncy,
            plane.vwgt,
            workers,
            adjwgt=plane.adjwgt,
            tpwgts=np.repeat(share[:, None], ncon, axis=1),
            ubvec=np.full(ncon, 1.0 + imbalance),
            algorithm=algorithm,
            objective=objective or "cut",
            seed=seed,
            ncuts=ncuts,
            niter=niter,
        ).parts
        blocks_from_plane(graph, plane, cell_owner, workers, out)
    for lb in (lb for lb in graph.layers if graph.spec.is_flat(lb.index)):
        out[lb.ids] = quantile_cut(graph.flops[lb.ids].astype(np.float64), share)
    out = rebalance(graph, out, workers, imbalance, share)
    return follow_pools(graph, out, workers, share) if graph.granularity.align_pools else out


def _grid_factors(workers: int) -> tuple[int, int]:
    """py x px = workers with py <= px as close to square as possible."""
    py = math.isqrt(workers)
    while workers % py:
        py -= 1
    return py, workers // py


def _spatial(graph: UnitGraph, workers: int, seed: int) -> np.ndarray:
    """Regular py x px tiles by block centre, the same relative grid in every layer."""
    del seed
    py, px = _grid_factors(workers)
    out = np.empty(graph.num_vertices, dtype=np.int64)
    for lb in graph.layers:
        ids = lb.ids
        if not graph.spec.is_flat(lb.index):
            b = graph.box[ids]
            cy = (b[:, 2] + b[:, 3]) / 2.0 / lb.shape.height
            cx = (b[:, 4] + b[:, 5]) / 2.0 / lb.shape.width
            ty = np.minimum((cy * py).astype(np.int64), py - 1)
            tx = np.minimum((cx * px).astype(np.int64), px - 1)
            out[ids] = ty * px + tx
        else:
            out[ids] = (np.arange(lb.count) * workers) // lb.count
    return out


def _brick_counts(workers: int, bands: int | None = None) -> np.ndarray:
    """Tiles per band: `bands` bands of near-equal counts; by default a near-square grid when P
    factors so, else round(sqrt(P)) bands."""
    if bands is None:
        py, px = _grid_factors(workers)
        if px <= 2 * py:  # a near-square grid exists
            return np.full(py, px)
        bands = max(1, round(math.sqrt(workers)))
    return np.full(bands, workers // bands) + (np.arange(bands) < workers % bands)


def default_bands(workers: int) -> int:
    """The number of bands `tiles` uses when none is given."""
    return len(_brick_counts(workers))


def _tiles(
    graph: UnitGraph,
    workers: int,
    seed: int,
    capacities: list[float] | None = None,
    bands: int | None = None,
) -> np.ndarray:
    """Brick tiles (bands of near-equal tile counts), cut in every layer at its weight quantiles.

    Bands first: blocks ordered by (row, column, channel) and cut into bands whose weight is
    proportional to their tile count; then each band ordered by (column, row, channel) and cut
    into its tiles. Cuts land at the same relative place in every layer, so receptive fields
    stay aligned, and every layer is balanced to within one block; a cut may pass between a
    position's channel groups. On a graph built with `align_pools`, a pool's input then
    follows the pool (`follow_pools`).
    """
    del seed
    counts = _brick_counts(workers, bands)
    first = np.concatenate([[0], np.cumsum(counts)])
    share = np.full(workers, 1.0 / workers)
    if capacities is not None:
        share = np.asarray(capacities, dtype=np.float64) / np.sum(capacities)
    band_share = np.add.reduceat(share, first[:-1])
    out = np.empty(graph.num_vertices, dtype=np.int64)
    for lb in graph.layers:
        ids = lb.ids
        w = graph.flops[ids].astype(np.float64)
        if graph.spec.is_flat(lb.index):
            out[ids] = quantile_cut(w, share)
            continue
        b = graph.box[ids]
        cy, cx, ch = b[:, 2] + b[:, 3], b[:, 4] + b[:, 5], b[:, 0]
        order = np.lexsort((ch, cx, cy))
        band = np.empty(len(ids), dtype=np.int64)
        band[order] = quantile_cut(w[order], band_share)
        for j, (lo, hi) in enumerate(itertools.pairwise(first)):
            members = np.nonzero(band == j)[0]
            if len(members) == 0:
                continue
            order = members[np.lexsort((ch[members], cy[members], cx[members]))]
            out[ids[order]] = lo + quantile_cut(w[order], share[lo:hi] / share[lo:hi].sum())
    return follow_pools(graph, out, workers, share) if graph.granularity.align_pools else out


def _stripe(graph: UnitGraph, workers: int, seed: int) -> np.ndarray:
    del seed
    out = np.empty(graph.num_vertices, dtype=np.int64)
    for lb in graph.layers:
        out[lb.ids] = (np.arange(lb.count) * workers) // lb.count
    return out


def _layers(graph: UnitGraph, workers: int, seed: int) -> np.ndarray:
    """Contiguous layers per worker, cut where cumulative FLOPs cross multiples of total/P."""
    del seed
    per_layer = np.bincount(graph.layer_of, weights=graph.flops, minlength=len(graph.layers))
    mid = np.cumsum(per_layer) - per_layer / 2.0
    worker_of_layer = np.minimum((mid / per_layer.sum() * workers).astype(np.int64), workers - 1)
    return worker_of_layer[graph.layer_of]


def _round_robin(graph: UnitGraph, workers: int, seed: int) -> np.ndarray:
    del seed
    return np.arange(graph.num_vertices, dtype=np.int64) % workers


def _random(graph: UnitGraph, workers: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, workers, graph.num_vertices)


METHODS: dict[str, Callable[..., np.ndarray]] = {
    "metis": _metis,
    "metis-aligned": _metis_aligned,
    "tiles": _tiles,
    "spatial": _spatial,
    "stripe": _stripe,
    "layers": _layers,
    "round-robin": _round_robin,
    "random": _random,
}

ALIGNED = ("metis-aligned", "tiles")  # methods planned on a graph built with align_pools

METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "metis": ("imbalance", "capacities", "algorithm", "objective", "ncuts", "niter"),
    "metis-aligned": ("imbalance", "capacities", "algorithm", "objective", "ncuts", "niter"),
    "tiles": ("capacities", "bands"),
}


def _check_options(method: str, workers: int, options: dict[str, Any]) -> None:
    allowed = METHOD_OPTIONS.get(method, ())
    for key in options:
        if key not in allowed:
            hint = f"allowed: {', '.join(allowed)}" if allowed else "it takes no options"
            raise PlanError(f"unknown option {key!r} for method {method!r}; {hint}")
    imb = options.get("imbalance")
    if imb is not None and not (0 < imb < 1):
        raise PlanError(f"imbalance must be in (0, 1) (0.03 = 3%), got {imb}")
    caps = options.get("capacities")
    if caps is not None and (len(caps) != workers or any(not (c > 0) for c in caps)):
        raise PlanError(f"capacities must be {workers} positive numbers, got {list(caps)}")
    algorithm = options.get("algorithm", "kway" if method == "metis-aligned" else "recursive")
    if algorithm not in ("recursive", "kway"):
        raise PlanError(f"algorithm must be 'recursive' or 'kway', got {algorithm!r}")
    objective = options.get("objective")
    if objective not in (None, "vol", "cut"):
        raise PlanError(f"objective must be 'vol' or 'cut', got {objective!r}")
    if algorithm == "recursive" and objective == "vol":
        raise PlanError("objective 'vol' needs algorithm 'kway' (recursive bisection cuts edges)")
    bands = options.get("bands")
    if bands is not None and (not isinstance(bands, int) or not 1 <= bands <= workers):
        raise PlanError(f"bands must be an integer in 1..{workers} (the workers), got {bands!r}")
    for key in ("ncuts", "niter"):
        if key in options and (not isinstance(options[key], int) or options[key] < 1):
            raise PlanError(f"{key} must be an integer >= 1, got {options[key]!r}")


def assign(
    graph: UnitGraph, workers: int, method: str, seed: int, options: dict[str, Any]
) -> np.ndarray:
    """Node map (int64 [V], values in 0..workers-1) of `method`; raises PlanError on bad input."""
    if method not in METHODS:
        raise PlanError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    _check_options(method, workers, options)
    if workers == 1:
        return np.zeros(graph.num_vertices, dtype=np.int64)
    return METHODS[method](graph, workers, seed, **options).astype(np.int64)
