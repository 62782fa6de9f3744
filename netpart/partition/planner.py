"""Planning: a spec and a worker count in, the best `PartitionPlan` out (pure functions).

`plan` runs one partitioner (`netpart.partition.methods`) on the unit graph and measures the
result (`netpart.partition.figures`); `auto`, the default, weighs several candidates and keeps
the one with the lowest predicted step (`AUTO_RULE`), recording every candidate in the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.cost import NetworkModel
from netpart.partition.figures import evaluate
from netpart.partition.graph import Granularity, UnitGraph, build_unit_graph
from netpart.partition.methods import ALIGNED, METHOD_OPTIONS, METHODS, assign, default_bands
from netpart.partition.plans import Candidate, PartitionPlan

__all__ = ["AUTO", "AUTO_RULE", "TIE", "auto_candidates", "choose", "plan"]

TIE = 0.02  # predicted steps this close count as equal: the model is not finer than that
AUTO_RULE = (
    f"lowest predicted step; candidates within {TIE:.0%} of it count as tied and the lowest "
    "volume among them wins"
)


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
    return replace(plans[choose(candidates)], candidates=candidates, rule=AUTO_RULE)


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
