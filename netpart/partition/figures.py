"""A plan's figures: exact halo traffic, the lower bound, per-layer balance and the predicted
step time of an assignment (pure functions over a `UnitGraph` and a node map).

`evaluate` gives every figure `plan.json` records; `interior_shares` and `chain_shares` the
work a worker can do while its halo travels, which the step-time model hides it behind;
`input_values` the values each slice reads (a calibrated model's gather cost).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.cost import NetworkModel, step_times
from netpart.partition.graph import BYTES_PER_VALUE, UnitGraph, build_unit_graph, read_window
from netpart.partition.plans import LayerFigures, PartitionPlan, PlanMetrics, WorkerFigures
from netpart.partition.volume import layer_lower_bounds, layer_traffic, workers_per_layer

__all__ = ["chain_shares", "evaluate", "input_values", "interior_shares", "reevaluate"]


def evaluate(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    batch: int,
    network: NetworkModel,
    capacities: list[float] | None = None,
) -> tuple[PlanMetrics, tuple[LayerFigures, ...], tuple[WorkerFigures, ...]]:
    """All figures of an assignment: exact traffic, bound, balance, predicted step time."""
    spec, nlayers = graph.spec, len(graph.layers)
    traffic = layer_traffic(graph, node_map, workers)  # [L, P, P]
    flops = np.zeros((nlayers, workers), dtype=np.int64)
    np.add.at(flops, (graph.layer_of, node_map), graph.flops)
    share = np.full(workers, 1.0 / workers)
    if capacities is not None:
        share = np.asarray(capacities, dtype=np.float64) / np.sum(capacities)
    spread = workers_per_layer(graph, workers)
    speed = share * workers  # relative speed of each worker (1.0 on equal machines)
    # Imbalance: worst load relative to a fair share of the q_l workers a layer can use.
    used = flops > 0
    fair = flops.sum(axis=1, keepdims=True) * share[None, :] * workers / spread[:, None]
    imbalance = (flops / fair).max(axis=1)
    kinds = [layer.kind for layer in spec.layers]
    values = input_values(graph, node_map, workers, traffic)
    u, v, w = graph.edge_list()
    interior = chains = None
    if network.overlap:
        interior = interior_shares(graph, node_map, workers, (u, v))
        chains = chain_shares(graph, node_map, workers, (u, v))
    keys = spec.layer_keys()
    args = (flops / speed[None, :], traffic, batch, network, kinds, values, interior, chains)
    compute, exchange, path = step_times(*args, keys)  # path <= compute.sum() + exchange.sum()
    fixed = network.fixed_s(workers)
    lower = layer_lower_bounds(spec, used.sum(axis=1))
    per_layer_volume = traffic.sum(axis=(1, 2))

    edge_cut = int(w[node_map[u] != node_map[v]].sum())
    metrics = PlanMetrics(
        edge_cut=edge_cut,
        volume=int(per_layer_volume.sum()),
        lower_bound=int(lower.sum()),
        max_layer_imbalance=float(imbalance.max()),
        predicted_step_s=float(path + fixed),
        compute_s=float(min(compute.sum(), path)),
        exchange_s=float(max(path - compute.sum(), 0.0)),
    )
    layers = tuple(
        _layer_figures(
            graph, i, spread, used, per_layer_volume, lower, imbalance, (compute, exchange)
        )
        for i in range(nlayers)
    )
    return metrics, layers, _worker_figures(graph, node_map, traffic, flops)


def _layer_figures(graph, i, spread, used, volume, lower, imbalance, times) -> LayerFigures:
    """Layer `i`'s figures from the per-layer arrays of `evaluate`."""
    compute, exchange = times
    return LayerFigures(
        name=graph.spec.layer_name(i),
        shape=str(graph.spec.shapes[i]),
        blocks=graph.layers[i].count,
        spread=int(spread[i]),
        workers_used=int(used[i].sum()),
        volume=int(volume[i]),
        lower_bound=int(lower[i]),
        imbalance=float(imbalance[i]),
        compute_s=float(compute[i]),
        exchange_s=float(exchange[i]),
    )


def _worker_figures(
    graph: UnitGraph, node_map: np.ndarray, traffic: np.ndarray, flops: np.ndarray
) -> tuple[WorkerFigures, ...]:
    """Per worker: FLOPs per layer, parameters held, halo bytes in and out, neighbours."""
    workers = flops.shape[1]
    params = _worker_params(graph, node_map, workers)
    total = traffic.sum(axis=0)
    links = (total + total.T) > 0
    return tuple(
        WorkerFigures(
            worker=d,
            flops=tuple(int(x) for x in flops[:, d]),
            params=int(params[d]),
            halo_in_bytes=int(total[:, d].sum() * BYTES_PER_VALUE),
            halo_out_bytes=int(total[d, :].sum() * BYTES_PER_VALUE),
            neighbours=tuple(int(x) for x in np.nonzero(links[d])[0]),
        )
        for d in range(workers)
    )


def _worker_params(graph: UnitGraph, node_map: np.ndarray, workers: int) -> np.ndarray:
    """Parameters each worker holds: untied weights of its units; a conv's kernels per channel."""
    spec = graph.spec
    out = np.zeros(workers, dtype=np.int64)
    for lb in graph.layers:
        layer, src = spec.layers[lb.index], spec.input_shape(lb.index)
        ids = lb.ids
        if layer.kind in ("local", "dense"):  # untied: every unit has its own weights
            per_unit = spec.layer_params(lb.index) // lb.shape.size
            units = np.bincount(node_map[ids], weights=graph.units[ids], minlength=workers)
            out += units.astype(np.int64) * per_unit
        elif layer.kind == "conv":
            # A worker needs the kernel of every output channel it computes any unit of.
            group = np.arange(lb.count) // (lb.ny * lb.nx)
            holds = np.zeros((workers, lb.nc), dtype=bool)
            holds[node_map[ids], group] = True
            per_channel = src.channels * layer.kernel**2 + 1
            out += holds.astype(np.int64) @ (np.diff(lb.cbounds) * per_channel)
    return out


def input_values(
    graph: UnitGraph, node_map: np.ndarray, workers: int, traffic: np.ndarray
) -> np.ndarray:
    """[L, P]: values per example worker w's slice of layer l reads from its input (and
    scatters its gradient back into): local and conv a window of every input channel per
    owned position and channel group, pool a window per unit, dense the whole input, lcn its
    input buffer (its own units of the layer below and the halo it receives)."""
    spec, layers = graph.spec, len(graph.layers)
    owned = np.zeros((layers, workers), dtype=np.float64)
    np.add.at(owned, (graph.layer_of, node_map), graph.units)
    out = traffic.sum(axis=1).astype(np.float64)  # halo received, per layer and worker
    out[1:] += owned[:-1]
    for lb in graph.layers:
        kind, ids = spec.layers[lb.index].kind, lb.ids
        if kind == "dense":
            out[lb.index] = np.where(owned[lb.index] > 0, spec.input_shape(lb.index).size, 0)
            continue
        if kind not in ("local", "conv", "pool"):
            continue
        window = read_window(spec, lb.index)[0] ** 2
        if kind == "pool":  # one window of the unit's own channel
            reads = graph.units[ids] * window
        else:  # one window of every input channel per position of a channel group
            channels = np.diff(lb.cbounds)[np.arange(lb.count) // (lb.ny * lb.nx)]
            reads = graph.units[ids] / channels * spec.input_shape(lb.index).channels * window
        out[lb.index] = np.bincount(node_map[ids], weights=reads, minlength=workers)
    return out


def interior_shares(
    graph: UnitGraph, node_map: np.ndarray, workers: int, edges: tuple | None = None
) -> np.ndarray:
    """[L, P]: the share of worker w's units of layer l in blocks that read no block of
    another worker (what it can compute while its halo travels; blocks, not units: a block
    with one boundary unit counts as boundary, so this errs low). `edges`: the graph's (u, v)
    edge list, where the caller has it."""
    u, v = edges if edges is not None else graph.edge_list()[:2]
    reader = np.where(graph.layer_of[u] > graph.layer_of[v], u, v)
    boundary = np.zeros(graph.num_vertices, dtype=bool)
    boundary[reader[node_map[u] != node_map[v]]] = True
    shape = (len(graph.layers), workers)
    total, inner = np.zeros(shape), np.zeros(shape)
    np.add.at(total, (graph.layer_of, node_map), graph.units)
    keep = ~boundary
    np.add.at(inner, (graph.layer_of[keep], node_map[keep]), graph.units[keep])
    return np.divide(inner, total, out=np.zeros(shape), where=total > 0)


def chain_shares(
    graph: UnitGraph, node_map: np.ndarray, workers: int, edges: tuple | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(late [L, P], feeds [L, P]): for each layer of a worker's producer chain
    (`netpart.partition.chains`, here on blocks), the share of its units computed after the
    halo above is posted, and the layer whose exchange that work hides (-1 outside chains).
    A block with one early unit counts as early, so this errs low, as `interior_shares`."""
    u, v = edges if edges is not None else graph.edge_list()[:2]
    lo, hi = (
        np.where(graph.layer_of[u] < graph.layer_of[v], u, v),
        np.where(graph.layer_of[u] < graph.layer_of[v], v, u),
    )  # (read, reader)
    cross = node_map[lo] != node_map[hi]
    layers = len(graph.layers)
    shape = (layers, workers)
    total = np.zeros(shape)
    np.add.at(total, (graph.layer_of, node_map), graph.units)
    receives, sends = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    receives[graph.layer_of[hi[cross]], node_map[hi[cross]]] = True
    sends[graph.layer_of[hi[cross]], node_map[lo[cross]]] = True
    late, feeds = np.zeros(shape), np.full(shape, -1, dtype=np.int64)
    dense = np.array([layer.kind == "dense" for layer in graph.spec.layers])
    for w in range(workers):
        mine = node_map[lo] == w  # edges reading this worker's blocks: all a chain follows
        lo_w, hi_w, out_w = lo[mine], hi[mine], cross[mine]
        for top in np.flatnonzero(sends[:, w])[::-1]:
            want = np.zeros(graph.num_vertices, dtype=bool)
            want[lo_w[out_w & (graph.layer_of[hi_w] == top)]] = True
            chain = []
            layer = top - 1
            while layer >= 0 and want.any() and not dense[layer] and not receives[layer, w]:
                early = float(graph.units[want].sum())
                if early >= total[layer, w] or feeds[layer, w] >= 0:
                    break
                chain.append((layer, 1.0 - early / total[layer, w]))
                if layer == 0 or sends[layer, w]:
                    break
                step = want[hi_w]
                want = np.zeros_like(want)
                want[lo_w[step]] = True
                layer -= 1
            for layer, share in chain:
                late[layer, w], feeds[layer, w] = share, top
    return late, feeds


def reevaluate(
    spec: ModelSpec, plan_: PartitionPlan, batch: int, network: NetworkModel
) -> PartitionPlan:
    """The same assignment's figures at another batch size or under another network model
    (a calibrated profile): the node map is kept, every metric is recomputed."""
    graph = build_unit_graph(spec, plan_.granularity)
    metrics, layers, per_worker = evaluate(
        graph, plan_.node_map, plan_.workers, batch, network, plan_.options.get("capacities")
    )
    return replace(
        plan_, batch=batch, network=network, metrics=metrics, layers=layers,
        per_worker=per_worker,
    )  # fmt: skip
