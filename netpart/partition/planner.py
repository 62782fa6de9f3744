"""Planning: a spec and a worker count in, the best `PartitionPlan` out (pure functions).

`plan` runs one partitioner (`netpart.partition.methods`) on the unit graph and measures the
result (`netpart.partition.evaluate`); `auto`, the default, weighs several candidates and keeps
the one with the lowest predicted step (`AUTO_RULE`), recording every candidate in the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from netpart.cost.machine import Machine
from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.blocks import Granularity
from netpart.partition.evaluate import evaluate, screen, step_floor
from netpart.partition.graph import build_unit_graph, graph_size
from netpart.partition.methods import ALIGNED, METHOD_OPTIONS, METHODS, assign, default_bands
from netpart.partition.plans import Candidate, PartitionPlan

__all__ = [
    "AUTO",
    "AUTO_RULE",
    "TIE",
    "Planner",
    "auto_candidates",
    "check_size",
    "choose",
    "plan",
]

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
    network: Machine | None = None,
    granularity: Granularity | None = None,
    on_phase: Callable[[str], None] | None = None,
    memory: int | None = None,
    **options: Any,
) -> PartitionPlan:
    """Partition `spec` over `workers` with `method` and measure the result.

    `auto` (the default) plans with every method of `auto_candidates` and keeps the plan with
    the lowest predicted step (AUTO_RULE); the plan records every candidate. Options of
    `metis`: imbalance (0.03), capacities (per-worker relative speeds), algorithm, objective
    ("vol" | "cut"), ncuts, niter; `auto` passes imbalance and capacities to the candidates
    that take them. `tiles` and `metis-aligned` plan on a graph with `align_pools` (pools'
    inputs follow the pools). Raises PlanError for bad input. `memory`: the bytes the caller
    can spare (the command line gives it); then more workers than the widest layer has
    blocks, or a plan that would not fit, are refused before any graph is built (a library
    caller may plan idle workers, as the tests do).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanError(f"workers must be an integer >= 1, got {workers!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"batch must be an integer >= 1, got {batch!r}")
    network = network or Machine()
    granularity = granularity or Granularity.for_workers(workers)
    if memory is not None:
        check_size(spec, workers, granularity, memory)
    phase = on_phase or (lambda _name: None)
    run = Planner(spec, workers, seed, batch, network, granularity, phase)
    metis_too_big = _metis_too_big(spec, granularity)
    if method != AUTO:
        if method not in METHODS:
            raise PlanError(f"unknown method {method!r}; use one of auto, {', '.join(METHODS)}")
        if method == "metis" and metis_too_big:
            raise PlanError(f"--method metis: {metis_too_big}; use auto, stripe or tiles")
        return run(method, dict(options))
    return _auto(run, spec, workers, options, metis_too_big)


def _auto(
    run: Planner, spec: ModelSpec, workers: int, options: dict[str, Any], metis_too_big: str
) -> PartitionPlan:
    """`auto`: every candidate of `auto_candidates` planned (METIS on the unit graph not
    where `metis_too_big` says why), the fastest kept (AUTO_RULE), every candidate recorded."""
    unknown = sorted(set(options) - {"imbalance", "capacities"})
    if unknown:
        raise PlanError(
            f"unknown option {unknown[0]!r} for method 'auto'; allowed: imbalance, capacities "
            "(choose a --method to tune one partitioner)"
        )
    plans, best = [], np.inf
    for name, extra in auto_candidates(spec, workers):
        if name == "metis" and metis_too_big:
            run.phase(f"metis: not weighed ({metis_too_big})")
            continue
        mine = {k: v for k, v in options.items() if k in METHOD_OPTIONS.get(name, ())}
        got = run(name, {**mine, **extra}, beat=best * (1 + TIE))
        plans.append(got)
        if isinstance(got, PartitionPlan):
            best = min(best, got.metrics.predicted_step_s)
    candidates = tuple(
        Candidate(p.method, p.method_options, p.metrics) if isinstance(p, PartitionPlan) else p
        for p in plans
    )
    return replace(plans[choose(candidates)], candidates=candidates, rule=AUTO_RULE)


AUTO = "auto"
# Peak bytes of a plan per read edge of its graph, and per (layer, worker, worker) entry of
# its traffic tables, read off the planner's largest benchmark (benchmarks/plan_bench.py).
BYTES_PER_EDGE, BYTES_PER_PAIR = 110, 64
# Peak bytes per unit of the largest layer and its input: the planner's unit-level arrays
# (owners, coverage, halo units), fitted to plans of one locally connected layer of 1M to
# 9M units.
BYTES_PER_UNIT = 32
# Balance weights (blocks x layers: one constraint per layer) beyond which METIS on the unit
# graph takes minutes: a chain of 1,000 small dense layers holds 16M and took METIS 4.6 s.
METIS_MOST_WEIGHTS = 20_000_000


def _metis_too_big(spec: ModelSpec, granularity: Granularity) -> str:
    """Why METIS on the unit graph is not worth running for `spec`, or "" if it is (a layer
    graph's: one constraint per block grid over the stacked blocks, `partition.stacks`)."""
    if len(spec.layers) <= 32:  # 16,384 blocks a layer at most: under the limit
        return ""
    size = graph_size(spec, granularity)
    if spec.is_chain:
        constraints, blocks, what = len(spec.layers), size.blocks, "one a layer"
    else:
        constraints, blocks, what = size.grids, size.grid_blocks, "one a block grid"
    weights = blocks * constraints
    if weights <= METIS_MOST_WEIGHTS:
        return ""
    return (
        f"{constraints:,} balance constraints ({what}) over {blocks:,} blocks are "
        f"{weights:,} weights, more than METIS weighs in minutes ({METIS_MOST_WEIGHTS:,})"
    )


def check_size(spec: ModelSpec, workers: int, granularity: Granularity, memory: int) -> None:
    """Raise PlanError, before any graph is built, for more workers than the widest layer
    has blocks (a worker would own nothing anywhere) or a plan that needs more than
    `memory` bytes (estimated from the graph's edges and the worker pairs)."""
    size = graph_size(spec, granularity)
    if workers > size.widest:
        raise PlanError(
            f"{workers} workers for {spec.name}: its widest layer, {size.widest_layer}, is cut "
            f"into at most {size.widest} blocks, so at most {size.widest} workers can each own "
            "a part; plan fewer workers"
        )
    units = max(s.size + spec.input_shape(i).size for i, s in enumerate(spec.shapes))
    need = (
        size.edges * BYTES_PER_EDGE
        + len(spec.layers) * workers**2 * BYTES_PER_PAIR
        + units * BYTES_PER_UNIT
    )
    if need > memory:
        raise PlanError(
            f"planning {spec.name} on {workers} workers needs about {need / 2**30:.1f} GiB "
            f"({size.edges:,} read edges between {size.blocks:,} blocks, {units:,} units in "
            f"its largest layer and its input) and this machine has {memory / 2**30:.1f} GiB "
            "available; plan fewer workers, lower --blocks-per-worker, or a smaller model"
        )


def auto_candidates(spec: ModelSpec, workers: int) -> list[tuple[str, dict[str, Any]]]:
    """The (method, options) `auto` weighs: METIS on both graphs and `tiles` with its default
    bands, one and two more (a brick tiling's halo is not monotone in its bands) for models
    with spatial layers; METIS and `stripe` for the rest."""
    if workers == 1:  # every method gives the one worker everything
        return [("metis", {})]
    if all(spec.is_flat(i) for i in range(len(spec.layers))):
        return [("metis", {}), ("stripe", {})]
    out: list[tuple[str, dict[str, Any]]] = [("metis", {}), ("metis-aligned", {}), ("tiles", {})]
    bands = default_bands(workers)
    out += [("tiles", {"bands": b}) for b in (bands + 1, bands + 2) if b <= workers]
    return out


def choose(candidates: tuple[Candidate, ...]) -> int:
    """Index of the candidate AUTO_RULE picks: among those whose predicted step is within TIE
    of the fastest, the one with the lowest volume (then the faster, then the first). A
    skipped candidate (its step a lower bound, out of the tie) is never picked."""
    weighed = [i for i, c in enumerate(candidates) if not c.skipped]
    fastest = min(candidates[i].metrics.predicted_step_s for i in weighed)
    tied = [i for i in weighed if candidates[i].metrics.predicted_step_s <= fastest * (1 + TIE)]
    return min(
        tied, key=lambda i: (candidates[i].metrics.volume, candidates[i].metrics.predicted_step_s)
    )


@dataclass
class Planner:
    """Plans one method at a time. The graph of a granularity is built once: candidates of
    one granularity come in a row, and `build_unit_graph` keeps the last graph it built."""

    spec: ModelSpec
    workers: int
    seed: int
    batch: int
    network: Machine
    granularity: Granularity
    phase: Callable[[str], None]

    def __call__(
        self, method: str, options: dict[str, Any], beat: float = np.inf
    ) -> PartitionPlan | Candidate:
        """The plan of `method`; a skipped `Candidate` instead, with its cheap figures, when
        a lower bound on its step is above `beat` (it cannot win: the rest is not worth its
        cost)."""
        granularity = self.granularity
        if method in ALIGNED:  # their cuts follow the pools: the graph must be cut there
            granularity = replace(granularity, align_pools=True)
        self.phase(f"{method}: graph")
        graph = build_unit_graph(self.spec, granularity)
        self.phase(f"{method}: partition")
        node_map = assign(graph, self.workers, method, self.seed, options)
        self.phase(f"{method}: metrics")
        caps = options.get("capacities")
        if np.isfinite(beat):
            floor = step_floor(graph, node_map, self.workers, self.batch, self.network, caps)
            if floor > beat:
                why = (
                    f"its compute alone, {floor * 1e3:.2f} ms a step, is more than the tie "
                    f"with the best so far allows ({beat * 1e3:.2f} ms)"
                )
                cheap = screen(graph, node_map, self.workers, caps, floor)
                return Candidate(method, options, cheap, skipped=why)
        metrics, layers, per_worker = evaluate(
            graph, node_map, self.workers, self.batch, self.network, caps
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
