"""PartitionPlan: which worker owns which block, and what that costs. Built by pure functions.

`plan.json` schema (version 1), written next to `node_map.npy` (int64 [blocks], block -> worker,
block ids as in `UnitGraph`, i.e. contiguous per layer in (channel group, row, column) order)::

    schema_version      1
    model, fingerprint  the ModelSpec's name and architecture digest; loading checks the digest
    method, seed        partitioner and its seed; options: method options + granularity
                        ({spatial_blocks, dense_blocks, max_blocks, align_pools}: the graph the
                        node map indexes; align_pools absent in older files means false)
    workers, batch      worker count; batch size the step-time prediction assumes
    network             {bandwidth_bps, latency_s, flops_per_s} of the prediction; with a
                        calibrated profile also kinds ({kind: {fixed_s, flops_per_s}}),
                        step_fixed_s, collective_s and profile (its path)
    metrics             edge_cut (units read across workers, summed over cut block edges),
                        volume and lower_bound (activation values sent per example per forward
                        pass; backward sends as many gradients back; the bound is for the number
                        of workers each layer is spread over), max_layer_imbalance
                        (max over layers of max/mean worker FLOPs, mean over the min(P, blocks)
                        workers a layer can be spread over), predicted_step_s, compute_s,
                        exchange_s
    layers              per layer: name, shape, blocks, spread (min(P, blocks)), workers_used,
                        volume, lower_bound, imbalance, compute_s, exchange_s
    per_worker          per worker: flops (forward+backward per example, per layer), params,
                        halo_in_bytes / halo_out_bytes (forward, per example), neighbours
    auto                (only when `--method auto` chose the plan) {rule, candidates: [{method,
                        options, metrics}]}: every plan weighed; `method` and `options` above
                        are the winner's, so the plan re-runs with an explicit --method
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.cost import NetworkModel, step_times
from netpart.partition.graph import (
    BYTES_PER_VALUE,
    Granularity,
    UnitGraph,
    build_unit_graph,
    read_window,
)
from netpart.partition.methods import (
    ALIGNED,
    METHOD_OPTIONS,
    METHODS,
    assign,
    default_bands,
)
from netpart.partition.volume import layer_lower_bounds, layer_traffic, workers_per_layer

__all__ = [
    "AUTO_RULE",
    "SCHEMA_VERSION",
    "TIE",
    "Candidate",
    "LayerFigures",
    "PartitionPlan",
    "PlanMetrics",
    "WorkerFigures",
    "auto_candidates",
    "chain_shares",
    "choose",
    "evaluate",
    "input_values",
    "interior_shares",
    "plan",
    "reevaluate",
]

SCHEMA_VERSION = 1
TIE = 0.02  # predicted steps this close count as equal: the model is not finer than that
AUTO_RULE = (
    f"lowest predicted step; candidates within {TIE:.0%} of it count as tied and the lowest "
    "volume among them wins"
)


@dataclass(frozen=True)
class PlanMetrics:
    edge_cut: int
    volume: int
    lower_bound: int
    max_layer_imbalance: float
    predicted_step_s: float
    compute_s: float
    exchange_s: float

    @property
    def volume_ratio(self) -> float:
        """volume / lower_bound (inf when the bound is 0 but traffic is not)."""
        if self.lower_bound == 0:
            return 1.0 if self.volume == 0 else float("inf")
        return self.volume / self.lower_bound


@dataclass(frozen=True)
class Candidate:
    """A plan `auto` weighed: its method, the options it ran with, and its figures."""

    method: str
    options: dict[str, Any]
    metrics: PlanMetrics

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "options": self.options, "metrics": asdict(self.metrics)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(d["method"], dict(d["options"]), PlanMetrics(**d["metrics"]))


@dataclass(frozen=True)
class LayerFigures:
    name: str
    shape: str
    blocks: int
    spread: int
    workers_used: int
    volume: int
    lower_bound: int
    imbalance: float
    compute_s: float
    exchange_s: float


@dataclass(frozen=True)
class WorkerFigures:
    worker: int
    flops: tuple[int, ...]
    params: int
    halo_in_bytes: int
    halo_out_bytes: int
    neighbours: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PartitionPlan:
    """A node map with its provenance and figures. Equal plans have equal JSON and node maps."""

    model: str
    fingerprint: str
    method: str
    workers: int
    seed: int
    options: dict[str, Any]
    batch: int
    network: NetworkModel
    node_map: np.ndarray
    metrics: PlanMetrics
    layers: tuple[LayerFigures, ...]
    per_worker: tuple[WorkerFigures, ...]
    candidates: tuple[Candidate, ...] = ()
    schema_version: int = SCHEMA_VERSION

    @property
    def granularity(self) -> Granularity:
        return Granularity(**self.options["granularity"])

    @property
    def method_options(self) -> dict[str, Any]:
        """The options the method ran with (without the granularity of its graph)."""
        return {k: v for k, v in self.options.items() if k != "granularity"}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartitionPlan):
            return NotImplemented
        return self.to_dict() == other.to_dict() and np.array_equal(self.node_map, other.node_map)

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "seed": self.seed,
            "options": self.options,
            "workers": self.workers,
            "batch": self.batch,
            "network": self.network.to_dict(),
            "num_blocks": len(self.node_map),
            "metrics": asdict(self.metrics),
            "layers": [asdict(x) for x in self.layers],
            "per_worker": [asdict(x) for x in self.per_worker],
            **({"auto": self.auto_dict()} if self.candidates else {}),
        }

    def auto_dict(self) -> dict[str, Any]:
        return {"rule": AUTO_RULE, "candidates": [c.to_dict() for c in self.candidates]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, node_map: np.ndarray, source: str = "plan.json") -> PartitionPlan:
        """Parse `plan.json` text with its node map; raises PlanError naming what is wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"{source}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}"
            ) from None
        if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION:
            got = d.get("schema_version") if isinstance(d, dict) else None
            raise PlanError(
                f"{source}: schema_version {got!r} is not {SCHEMA_VERSION}; re-run `netpart plan`"
            )
        try:
            plan_ = cls(
                model=d["model"],
                fingerprint=d["fingerprint"],
                method=d["method"],
                workers=int(d["workers"]),
                seed=int(d["seed"]),
                options=d["options"],
                batch=int(d["batch"]),
                network=NetworkModel.from_dict(d["network"]),
                node_map=np.asarray(node_map, dtype=np.int64),
                metrics=PlanMetrics(**d["metrics"]),
                layers=tuple(LayerFigures(**x) for x in d["layers"]),
                per_worker=tuple(
                    WorkerFigures(
                        **{**x, "flops": tuple(x["flops"]), "neighbours": tuple(x["neighbours"])}
                    )
                    for x in d["per_worker"]
                ),
                candidates=tuple(
                    Candidate.from_dict(c) for c in d.get("auto", {}).get("candidates", [])
                ),
            )
            expected_blocks = int(d["num_blocks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"{source}: missing or invalid field ({exc}); re-run `netpart plan`"
            ) from None
        if plan_.node_map.ndim != 1 or len(plan_.node_map) != expected_blocks:
            raise PlanError(
                f"{source}: node_map.npy has {plan_.node_map.shape} entries, "
                f"plan.json expects {expected_blocks}"
            )
        if len(plan_.node_map) and (
            plan_.node_map.min() < 0 or plan_.node_map.max() >= plan_.workers
        ):
            raise PlanError(f"{source}: node_map.npy names workers outside 0..{plan_.workers - 1}")
        return plan_

    def check_model(self, spec: ModelSpec) -> None:
        """Raise PlanError unless this plan was made for `spec`'s architecture."""
        if spec.fingerprint() != self.fingerprint:
            raise PlanError(
                f"this plan is for model {self.model!r} (fingerprint {self.fingerprint}), not "
                f"{spec.name!r} (fingerprint {spec.fingerprint()}); re-run `netpart plan` for it"
            )


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
        LayerFigures(
            name=spec.layer_name(i),
            shape=str(spec.shapes[i]),
            blocks=graph.layers[i].count,
            spread=int(spread[i]),
            workers_used=int(used[i].sum()),
            volume=int(per_layer_volume[i]),
            lower_bound=int(lower[i]),
            imbalance=float(imbalance[i]),
            compute_s=float(compute[i]),
            exchange_s=float(exchange[i]),
        )
        for i in range(nlayers)
    )
    params = _worker_params(graph, node_map, workers)
    total = traffic.sum(axis=0)
    links = (total + total.T) > 0
    per_worker = tuple(
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
    return metrics, layers, per_worker


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


def plan(
    spec: ModelSpec,
    workers: int,
    method: str = "auto",
    *,
    seed: int = 0,
    batch: int = 32,
    network: NetworkModel | None = None,
    granularity: Granularity | None = None,
    on_phase: Callable[[str], None] | None = None,
    **options: Any,
) -> PartitionPlan:
    """Partition `spec` over `workers` with `method` and measure the result.

    `auto` (the default) plans with every method of `auto_candidates` and keeps the plan with
    the lowest predicted step (AUTO_RULE); the plan records every candidate. Options of
    `metis`: imbalance (0.03), capacities (per-worker relative speeds), algorithm, objective
    ("vol" | "cut"), ncuts, niter; `auto` passes imbalance and capacities to the candidates
    that take them. `tiles` and `metis-aligned` plan on a graph with `align_pools` (pools'
    inputs follow the pools). Raises PlanError for bad input.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanError(f"workers must be an integer >= 1, got {workers!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"batch must be an integer >= 1, got {batch!r}")
    network = network or NetworkModel()
    granularity = granularity or Granularity.for_workers(workers)
    phase = on_phase or (lambda _name: None)
    run = _Runner(spec, workers, seed, batch, network, granularity, phase)
    if method != AUTO:
        if method not in METHODS:
            raise PlanError(f"unknown method {method!r}; use one of auto, {', '.join(METHODS)}")
        return run(method, dict(options))
    unknown = sorted(set(options) - {"imbalance", "capacities"})
    if unknown:
        raise PlanError(
            f"unknown option {unknown[0]!r} for method 'auto'; allowed: imbalance, capacities "
            "(choose a --method to tune one partitioner)"
        )
    plans = [
        run(
            name,
            {**{k: v for k, v in options.items() if k in METHOD_OPTIONS.get(name, ())}, **extra},
        )
        for name, extra in auto_candidates(spec, workers)
    ]
    candidates = tuple(Candidate(p.method, p.method_options, p.metrics) for p in plans)
    return replace(plans[choose(candidates)], candidates=candidates)


AUTO = "auto"


def auto_candidates(spec: ModelSpec, workers: int) -> list[tuple[str, dict[str, Any]]]:
    """The (method, options) `auto` weighs: METIS on both graphs and `tiles` with its default
    bands, one and two more (a brick tiling's halo is not monotone in its bands) for models
    with spatial layers; METIS and `stripe` for the rest."""
    if workers == 1:  # every method gives the one worker everything
        return [("metis", {})]
    if not any(layer.is_spatial for layer in spec.layers):
        return [("metis", {}), ("stripe", {})]
    out: list[tuple[str, dict[str, Any]]] = [("metis", {}), ("metis-aligned", {}), ("tiles", {})]
    bands = default_bands(workers)
    out += [("tiles", {"bands": b}) for b in (bands + 1, bands + 2) if b <= workers]
    return out


def choose(candidates: tuple[Candidate, ...]) -> int:
    """Index of the candidate AUTO_RULE picks: among those whose predicted step is within TIE
    of the fastest, the one with the lowest volume (then the faster, then the first)."""
    fastest = min(c.metrics.predicted_step_s for c in candidates)
    tied = [
        i for i, c in enumerate(candidates) if c.metrics.predicted_step_s <= fastest * (1 + TIE)
    ]
    return min(
        tied, key=lambda i: (candidates[i].metrics.volume, candidates[i].metrics.predicted_step_s)
    )


@dataclass
class _Runner:
    """Plans one method at a time, reusing the last graph where the granularity is the same."""

    spec: ModelSpec
    workers: int
    seed: int
    batch: int
    network: NetworkModel
    granularity: Granularity
    phase: Callable[[str], None]
    graph: UnitGraph | None = None  # the last one built: candidates in a row share it

    def __call__(self, method: str, options: dict[str, Any]) -> PartitionPlan:
        granularity = self.granularity
        if method in ALIGNED:  # their cuts follow the pools: the graph must be cut there
            granularity = replace(granularity, align_pools=True)
        self.phase(f"{method}: graph")
        if self.graph is None or self.graph.granularity != granularity:
            self.graph = build_unit_graph(self.spec, granularity)
        graph = self.graph
        self.phase(f"{method}: partition")
        node_map = assign(graph, self.workers, method, self.seed, options)
        self.phase(f"{method}: metrics")
        metrics, layers, per_worker = evaluate(
            graph, node_map, self.workers, self.batch, self.network, options.get("capacities")
        )
        return PartitionPlan(
            model=self.spec.name,
            fingerprint=self.spec.fingerprint(),
            method=method,
            workers=self.workers,
            seed=self.seed,
            options={**options, "granularity": granularity.to_dict()},
            batch=self.batch,
            network=self.network,
            node_map=node_map,
            metrics=metrics,
            layers=layers,
            per_worker=per_worker,
        )
