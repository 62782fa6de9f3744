"""A plan's figures: exact halo traffic, the lower bound, per-layer balance and the predicted
step time of an assignment (pure functions over a `UnitGraph` and a node map).

`evaluate` gives every figure `plan.json` records; `interior_shares` and `chain_shares` the
work a worker can do while its halo travels, which the step-time model hides it behind;
`input_values` the values each slice reads (a calibrated model's gather cost).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from netpart.cost.machine import Machine
from netpart.cost.step import split_layers, step_times
from netpart.models.spec import BYTES_PER_VALUE, ModelSpec
from netpart.partition.graph import UnitGraph, build_unit_graph, narrow
from netpart.partition.plans import LayerFigures, PartitionPlan, PlanMetrics, WorkerFigures
from netpart.partition.reads import read_pairs, read_window
from netpart.partition.rectangles import convolved_units
from netpart.partition.volume import layer_lower_bounds, layer_traffic, workers_per_layer

__all__ = [
    "Crossing",
    "chain_shares",
    "convolved_shares",
    "evaluate",
    "input_values",
    "interior_shares",
    "norm_collectives",
    "per_layer_worker",
    "reevaluate",
    "screen",
    "step_floor",
]


def evaluate(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    batch: int,
    network: Machine,
    capacities: list[float] | None = None,
) -> tuple[PlanMetrics, tuple[LayerFigures, ...], tuple[WorkerFigures, ...]]:
    """All figures of an assignment: exact traffic, bound, balance, predicted step time."""
    spec, nlayers = graph.spec, len(graph.layers)
    traffic = layer_traffic(graph, node_map, workers)  # [L, P, P]
    flops = per_layer_worker(graph, node_map, workers, graph.flops).astype(np.int64)
    share = _shares(workers, capacities)
    spread = workers_per_layer(graph, workers)
    speed = share * workers  # relative speed of each worker (1.0 on equal machines)
    used = flops > 0
    imbalance = _imbalance(graph, flops, share)
    kinds = [layer.kind for layer in spec.layers]
    values = input_values(graph, node_map, workers, traffic)
    crossing = Crossing.of(graph, node_map)
    interior = interior_shares(graph, node_map, workers, crossing)
    chains = chain_shares(graph, node_map, workers, crossing)
    keys = spec.layer_keys()
    units = per_layer_worker(graph, node_map, workers, graph.units)
    convolved = convolved_shares(graph, node_map, workers)
    args = (flops / speed[None, :], traffic, batch, network, kinds, values)
    # path <= compute.sum() + exchange.sum(); nothing hides a halo without overlap
    # A layer graph (or batch norm) hides no halo: the runtime splits none of its layers.
    hidden = (interior, chains) if spec.hides_halo else (None, None)
    hiding = hidden if network.overlap else (None, None)
    joint = norm_collectives(spec, workers, network)
    compute, exchange, path = step_times(
        *args, *hiding, keys, convolved=convolved, collectives=joint
    )
    # What to split where the workers have machines of their own (on one host none is).
    on_own = replace(network, overlap=True)
    split, hideable = split_layers(*args[:3], on_own, *args[4:], *hidden, keys, convolved=convolved)
    fixed = network.fixed_s(workers)
    lower = layer_lower_bounds(spec, used.sum(axis=1))
    per_layer_volume = traffic.sum(axis=(1, 2))

    edge_cut = int(graph.reads[2][crossing.cross].sum())
    metrics = PlanMetrics(
        edge_cut=edge_cut,
        volume=int(per_layer_volume.sum()),
        lower_bound=int(lower.sum()),
        max_layer_imbalance=float(imbalance.max()),
        predicted_step_s=float(path + fixed),
        compute_s=float(min(compute.sum(), path)),
        exchange_s=float(max(path - compute.sum(), 0.0)),
    )
    times = (compute, exchange, split, hideable, _convolved_layers(graph, convolved, units))
    layers = tuple(
        _layer_figures(graph, i, spread, used, per_layer_volume, lower, imbalance, times)
        for i in range(nlayers)
    )
    return metrics, layers, _worker_figures(graph, node_map, traffic, flops)


def _convolved_layers(graph: UnitGraph, convolved: np.ndarray, units: np.ndarray) -> list:
    """[L]: the share of each conv layer's outputs torch's convolution computes (None for
    other kinds), from each worker's share (`convolved_shares`) and units."""
    return [
        float(convolved[i] @ units[i] / lb.shape.size) if lb.kind == "conv" else None
        for i, lb in enumerate(graph.layers)
    ]


def norm_collectives(spec: ModelSpec, workers: int, network: Machine) -> np.ndarray:
    """[L]: each batch norm's collective among the replica's workers, one direction: an
    all-reduce of each channel's two sums (float64: four float32 values a channel)."""
    return np.array(
        [
            network.allreduce_s(4 * spec.shapes[i].channels, workers)
            if layer.kind == "batchnorm"
            else 0.0
            for i, layer in enumerate(spec.layers)
        ]
    )


def step_floor(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    batch: int,
    network: Machine,
    capacities: list[float] | None = None,
) -> float:
    """A lower bound on an assignment's predicted step that costs little: the step with no
    halo at all (compute along each worker's own timeline, and the fixed costs). An exchange
    only adds to a step, and it is what costs most to evaluate (`evaluate`)."""
    spec = graph.spec
    flops = per_layer_worker(graph, node_map, workers, graph.flops)
    speed = _shares(workers, capacities) * workers
    none = np.zeros((len(graph.layers), workers, workers))
    kinds = [layer.kind for layer in spec.layers]
    values = input_values(graph, node_map, workers, none)
    convolved = convolved_shares(graph, node_map, workers)
    args = (flops / speed[None, :], none, batch, network, kinds, values)
    _, _, path = step_times(*args, keys=spec.layer_keys(), convolved=convolved)
    return float(path + network.fixed_s(workers))


def screen(
    graph: UnitGraph,
    node_map: np.ndarray,
    workers: int,
    capacities: list[float] | None,
    floor: float,
) -> PlanMetrics:
    """The figures of a skipped assignment: exact volume, bound, balance and edge cut, and
    `floor` (`step_floor`) for its step."""
    flops = per_layer_worker(graph, node_map, workers, graph.flops)
    traffic = layer_traffic(graph, node_map, workers)
    used = (flops > 0).sum(axis=1)
    share = _shares(workers, capacities)
    edge_cut = int(graph.reads[2][node_map[graph.reads[0]] != node_map[graph.reads[1]]].sum())
    return PlanMetrics(
        edge_cut=edge_cut,
        volume=int(traffic.sum()),
        lower_bound=int(layer_lower_bounds(graph.spec, used).sum()),
        max_layer_imbalance=float(_imbalance(graph, flops, share).max()),
        predicted_step_s=floor,
        compute_s=floor,
        exchange_s=0.0,
    )


def _shares(workers: int, capacities: list[float] | None) -> np.ndarray:
    """Each worker's share of the work (equal, or by its relative capacity)."""
    if capacities is None:
        return np.full(workers, 1.0 / workers)
    return np.asarray(capacities, dtype=np.float64) / np.sum(capacities)


def _imbalance(graph: UnitGraph, flops: np.ndarray, share: np.ndarray) -> np.ndarray:
    """[L]: each layer's worst load relative to a fair share of the workers it can use."""
    workers = len(share)
    spread = workers_per_layer(graph, workers)
    fair = flops.sum(axis=1, keepdims=True) * share[None, :] * workers / spread[:, None]
    return (flops / fair).max(axis=1)


def _layer_figures(graph, i, spread, used, volume, lower, imbalance, times) -> LayerFigures:
    """Layer `i`'s figures from the per-layer arrays of `evaluate`."""
    compute, exchange, split, hideable, convolved = times
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
        split=bool(split[i]),
        hideable_s=float(hideable[i]),
        convolved=convolved[i],
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
        layer = spec.layers[lb.index]
        ids = lb.ids
        if layer.kind in ("local", "dense"):  # untied: every unit has its own weights
            per_unit = spec.layer_params(lb.index) // lb.shape.size
            units = np.bincount(node_map[ids], weights=graph.units[ids], minlength=workers)
            out += units.astype(np.int64) * per_unit
        elif layer.kind in ("conv", "batchnorm"):
            # A worker needs the kernel (a batch norm: the scale and shift) of every output
            # channel it computes any unit of.
            group = np.arange(lb.count) // (lb.ny * lb.nx)
            holds = np.zeros((workers, lb.nc), dtype=bool)
            holds[node_map[ids], group] = True
            per_channel = spec.layer_params(lb.index) // lb.shape.channels
            out += holds.astype(np.int64) @ (np.diff(lb.cbounds) * per_channel)
    return out


def convolved_shares(graph: UnitGraph, node_map: np.ndarray, workers: int) -> np.ndarray:
    """[L, P]: the share of each worker's outputs of each conv layer torch's convolution
    computes (`partition.rectangles.convolved_units`; the rest multiply gathered patches),
    0 for other kinds: what the cost model prices each path by."""
    units = per_layer_worker(graph, node_map, workers, graph.units)
    return convolved_units(graph, node_map, workers) / np.maximum(units, 1)


def input_values(
    graph: UnitGraph, node_map: np.ndarray, workers: int, traffic: np.ndarray
) -> np.ndarray:
    """[L, P]: values per example worker w's slice of layer l reads from its input (and
    scatters its gradient back into): local and conv a window of every input channel per
    owned position and channel group, pool a window per unit, dense the whole input, lcn its
    input buffer (its own units of the layer below and the halo it receives)."""
    spec = graph.spec
    owned = per_layer_worker(graph, node_map, workers, graph.units)
    out = traffic.sum(axis=1).astype(np.float64)  # halo received, per layer and worker
    for index, _, source in read_pairs(spec):
        out[index] += owned[source]
    for lb in graph.layers:
        kind, ids = spec.layers[lb.index].kind, lb.ids
        if kind == "dense":
            out[lb.index] = np.where(owned[lb.index] > 0, spec.input_shape(lb.index).size, 0)
            continue
        if kind not in ("local", "conv", "pool"):
            continue
        (kh, kw), _, _ = read_window(spec, lb.index)
        window = kh * kw
        if kind == "pool":  # one window of the unit's own channel
            reads = graph.units[ids] * window
        else:  # one window of every input channel per position of a channel group
            channels = np.diff(lb.cbounds)[np.arange(lb.count) // (lb.ny * lb.nx)]
            reads = graph.units[ids] / channels * spec.input_shape(lb.index).channels * window
        out[lb.index] = np.bincount(node_map[ids], weights=reads, minlength=workers)
    return out


def per_layer_worker(graph: UnitGraph, node_map: np.ndarray, workers: int, values) -> np.ndarray:
    """[L, P]: `values` (one per block) summed by (layer, owner); float64 (integer values
    sum exactly)."""
    at = graph.layer_of * workers + node_map
    sums = np.bincount(at, weights=values, minlength=len(graph.layers) * workers)
    return sums.reshape(len(graph.layers), workers)


@dataclass(frozen=True, eq=False)
class Crossing:
    """Which read edges of a graph cross workers under a node map: each edge's reader's
    owner and read block's owner, whether they differ, and where each reader layer's edges
    begin (`cuts`, one more than the layers). Computed once per evaluation."""

    reader_owner: np.ndarray
    read_owner: np.ndarray
    cross: np.ndarray
    cuts: np.ndarray

    @classmethod
    def of(cls, graph: UnitGraph, node_map: np.ndarray) -> Crossing:
        reader, read, _ = graph.reads
        small = narrow(node_map)
        owners = small[reader], small[read]
        return cls(owners[0], owners[1], owners[0] != owners[1], graph.read_cuts)


def interior_shares(
    graph: UnitGraph, node_map: np.ndarray, workers: int, crossing: Crossing | None = None
) -> np.ndarray:
    """[L, P]: the share of worker w's units of layer l in blocks that read no block of
    another worker (what it can compute while its halo travels; blocks, not units: a block
    with one boundary unit counts as boundary, so this errs low)."""
    crossing = crossing or Crossing.of(graph, node_map)
    boundary = np.zeros(graph.num_vertices, dtype=bool)
    boundary[graph.reads[0][crossing.cross]] = True
    total = per_layer_worker(graph, node_map, workers, graph.units)
    inner = per_layer_worker(graph, node_map, workers, np.where(boundary, 0, graph.units))
    return np.divide(inner, total, out=np.zeros_like(total), where=total > 0)


def chain_shares(
    graph: UnitGraph, node_map: np.ndarray, workers: int, crossing: Crossing | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(late [L, P], feeds [L, P]): for each layer of a worker's producer chain
    (`netpart.compile.chains`, here on blocks), the share of its units computed after the
    halo above is posted, and the layer whose exchange that work hides (-1 outside chains).
    A block with one early unit counts as early, so this errs low, as `interior_shares`.

    Every worker at once: a chain's wanted blocks are its worker's own, so one mask over the
    blocks holds every worker's; the read edges come grouped by their reader's layer, and a
    chain walks down one layer at a time (tops highest first: a layer feeds one top).
    A layer graph has no chains (every share 0, every feed -1)."""
    shape = (len(graph.layers), workers)
    if not graph.spec.is_chain:
        return np.zeros(shape), np.full(shape, -1, dtype=np.int64)
    c = crossing or Crossing.of(graph, node_map)
    hi, lo, _ = graph.reads  # (reader, read)
    cross, cuts = c.cross, c.cuts
    total = per_layer_worker(graph, node_map, workers, graph.units)
    receives, sends = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    for layer in range(1, len(graph.layers)):  # a layer's edges: one slice, no gathers
        at = slice(cuts[layer], cuts[layer + 1])
        out = cross[at]
        receives[layer] = np.bincount(c.reader_owner[at][out], minlength=workers) > 0
        sends[layer] = np.bincount(c.read_owner[at][out], minlength=workers) > 0
    dense = np.array([layer.kind == "dense" for layer in graph.spec.layers])
    late, feeds = np.zeros(shape), np.full(shape, -1, dtype=np.int64)
    for top in np.flatnonzero(sends.any(axis=1))[::-1]:
        at = slice(cuts[top], cuts[top + 1])  # edges whose reader is in `top`
        want = np.zeros(graph.num_vertices, dtype=bool)
        want[lo[at][cross[at]]] = True  # what each sender sends at `top`
        alive, member = sends[top].copy(), np.zeros(shape, dtype=bool)
        layer = top - 1
        while layer >= 0 and not dense[layer]:
            ids = np.flatnonzero(want)
            early = np.bincount(node_map[ids], weights=graph.units[ids], minlength=workers)
            has = np.bincount(node_map[ids], minlength=workers) > 0
            alive &= has & ~receives[layer] & (early < total[layer]) & (feeds[layer] < 0)
            if not alive.any():
                break
            member[layer] = alive
            late[layer, alive] = 1.0 - early[alive] / total[layer, alive]
            alive &= ~sends[layer]  # a chain ends at a layer that sends itself
            if layer == 0 or not alive.any():
                break
            at = slice(cuts[layer], cuts[layer + 1])  # edges whose reader is in `layer`
            readers = hi[at]
            step = ~cross[at] & want[readers] & alive[c.reader_owner[at]]
            want = np.zeros(graph.num_vertices, dtype=bool)
            want[lo[at][step]] = True
            layer -= 1
        feeds[member] = top
    return late, feeds


def reevaluate(
    spec: ModelSpec, plan_: PartitionPlan, batch: int, network: Machine
) -> PartitionPlan:
    """The same assignment's figures at another batch size or under another network model
    (a calibrated profile): the node map is kept, every metric is recomputed."""
    graph = build_unit_graph(spec, plan_.granularity)
    metrics, layers, per_worker = evaluate(
        graph, plan_.node_map, plan_.workers, batch, network, plan_.options.get("capacities")
    )
    return replace(
        plan_,
        batch=batch,
        network=network,
        metrics=metrics,
        layers=layers,
        per_worker=per_worker,
    )
