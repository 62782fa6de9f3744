"""Fitting a calibration's measurements into the step-time model: pure functions, no I/O.

`kind_cost` and `layer_costs` turn timed slices into tables (`netpart.cost.tables`);
`fit` turns the runs `netpart.calibrate.measure` measured into the terms beyond the tables:
the link's overhead per phase, the one-process step's fixed cost (and each calibration
model's layer tables scaled to its one-process step: `anchored`), the two-process step's
collective, compute slowdown and in-step cost per phase, and, where steps at more workers
were measured, what they held beyond all that (`crowd`). Every equation is weighted by 1 / its
measurement, so a small model counts as much as a large one, and every term is >= 0 (those
of `crowd` are corrections, bounded below: `crowd_terms`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from netpart.cost.machine import Machine
from netpart.cost.tables import KindCost, LayerCost
from netpart.models.spec import ModelSpec
from netpart.partition.evaluate import reevaluate
from netpart.partition.plans import PartitionPlan

__all__ = [
    "Crowd",
    "Plans",
    "anchored",
    "crowd_terms",
    "fit",
    "kind_cost",
    "layer_costs",
    "with_link",
]

ANCHOR_LOW, ANCHOR_HIGH = 0.5, 2.0  # bounds of a layer table's factor (`anchored`)
Plans = list[tuple[ModelSpec, PartitionPlan, PartitionPlan]]  # each model's 1- and 2-worker plan
# Per number of workers > 2, each model's (spec, plan for that many, measured step seconds).
Crowd = list[tuple[int, list[tuple[ModelSpec, PartitionPlan, float]]]]


def layer_costs(per_layer: dict[str, list], kinds: dict[str, KindCost]) -> dict[str, LayerCost]:
    """Each layer's own table (`LayerCost`) from its slices, where they have two sizes or
    more, floored at its kind's smallest slice."""
    out = {}
    for key, pts in sorted(per_layer.items()):
        if len({f for f, _ in pts}) > 1:
            floor = kinds[key.split()[0]].floor_s
            out[key] = LayerCost(tuple(sorted((float(f), float(t)) for f, t in pts)), floor)
    return out


def kind_cost(points: list[tuple[float, float, float, float]]) -> KindCost:
    """A kind's table, with the seconds per gathered input value that a fit of time to
    (1, FLOPs, values) gives where that lowers the table's error on its own points (a dense
    slice over a large input costs more than one of the same FLOPs over a small one)."""
    share = float(np.clip(np.median([s for *_, s in points]), 0.05, 0.95))
    f, v, t = np.array([p[:3] for p in points], dtype=np.float64).T
    plain = KindCost(tuple(sorted(zip(f, t, strict=True))), share)
    per_value = _lstsq(np.column_stack([np.ones_like(f), f, v]).tolist(), t.tolist(), t.tolist())[2]
    rest = t - per_value * v
    if per_value <= 0 or (rest <= 0).any():  # what the values leave of a slice is positive
        return plain
    with_values = KindCost(tuple(sorted(zip(f, rest, strict=True))), share, per_value)

    def error(cost: KindCost) -> float:
        return float(np.square(np.log(cost.seconds(f, v) / t)).sum())

    return with_values if error(with_values) < error(plain) else plain


def _lstsq(
    rows: list[list[float]],
    target: list[float],
    steps: list[float] | None = None,
    lower: list[float] | None = None,
):
    """Least squares with every unknown >= its `lower` bound (0 by default), by clamping the
    unknowns below theirs to it and refitting the rest; with `steps`, every equation weighted
    by 1 / its run's step time (relative errors count: a small model weighs as much as a
    large one)."""
    a, t = np.array(rows, dtype=float), np.array(target, dtype=float)
    low = np.zeros(a.shape[1]) if lower is None else np.array(lower, dtype=float)
    if steps is not None:
        w = 1.0 / np.maximum(np.array(steps, dtype=float), 1e-12)
        a, t = a * w[:, None], t * w
    sol, *_ = np.linalg.lstsq(a, t, rcond=None)
    if (sol < low).any():  # refit with those below their bound at it
        keep = sol >= low
        sol = low.copy()
        rest = t - a[:, ~keep] @ low[~keep]
        sol[keep] = np.linalg.lstsq(a[:, keep], rest, rcond=None)[0]
    return [float(v) for v in np.maximum(sol, low)]


def _two_process_terms(plans: Plans, runs, batch: int, model: Machine):
    """(collective_s, parallel_slowdown, in-step seconds per phase): what two-process steps
    hold beyond the model so far (the planner's own prediction, overlap included), fitted to
    a constant + a share of the compute + a cost per exchange phase (a phase in a step, with
    both workers computing around it, costs more than in the exchange-only runs). The last
    term's regressor is the prediction's own change per second added to every phase, so a
    phase hidden behind compute counts only as far as the model exposes it."""
    delta = 1e-4
    shifted = replace(model, link=_plus(model.link, delta))
    rows, rest, measured = [], [], []
    for (spec, _, two), run in zip(plans, runs, strict=True):
        p = reevaluate(spec, two, batch, model).metrics
        phases = (
            reevaluate(spec, two, batch, shifted).metrics.predicted_step_s - p.predicted_step_s
        ) / delta
        rows.append([1.0, p.compute_s, phases])
        rest.append(run["two"]["step_s"] - p.predicted_step_s)
        measured.append(run["two"]["step_s"])
    collective, slowdown, per_phase = _lstsq(rows, rest, measured)
    return collective, slowdown, per_phase


def _plus(tables: dict, seconds: float) -> dict:
    """Link tables with `seconds` more in every phase."""
    return {k: tuple((b, seconds + t) for b, t in v) for k, v in tables.items()}


def with_link(base: Machine, link: dict) -> Machine:
    """`base` with the link as measured, no overhead fitted yet, and the loss's collective:
    what a calibration sizes its step runs by before any step is timed (the slice tables
    alone price no exchange, and a two-machine step of a small model is mostly exchange).
    `base` itself where no link was measured (one machine)."""
    if not link["seconds"]:
        return base
    terms = _link_terms(link, [])
    return replace(base, link=terms["link"], gather=terms["gather"])


def _link_terms(link: dict, runs: list[dict], in_step: float = 0.0) -> dict:
    """The link tables the runtime's exchanges see and their summary (latency, bandwidth):
    the measured link + a per-phase overhead fitted to the exchange-only runs (each = sum
    over its phases of overhead + the one-peer link's time for the phase's bytes; weighted by
    1 / the run) + `in_step` (a phase's further cost in a step); and the loss's collective
    per number of workers. `link` holds bytes per peer and, per number of peers, seconds
    (and, per number of workers, `gather_s`)."""
    sizes = np.array(link["sizes"])
    raw = {int(k): tuple(zip(sizes * int(k), t, strict=True)) for k, t in link["seconds"].items()}
    two = [r["two"] for r in runs]
    phases = [2.0 * len(x["phase_bytes"]) for x in two]
    one_peer = Machine(link=raw)
    wire = [2.0 * float(one_peer.phase_s(np.array(x["phase_bytes"])).sum()) for x in two]
    exchange = [x["exchange_s"] for x in two]
    rest = [e - w for e, w in zip(exchange, wire, strict=True)]
    (overhead,) = _lstsq([[n] for n in phases], rest, exchange) if any(phases) else [0.0]
    tables = _plus(raw, overhead + in_step)
    b, secs = np.array(tables[1]).T
    latency, per_byte = _lstsq([[1.0, x] for x in b], list(secs), list(secs))
    gather = tuple(sorted((float(n), float(t)) for n, t in link.get("gather_s", {}).items()))
    return {
        "link": tables,
        "latency_s": latency,
        "bandwidth_bps": 8.0 / max(per_byte, 1e-15),
        "gather": gather,
    }


def fit(
    base: Machine,
    plans: Plans,
    runs: list[dict],
    batch: int,
    link: dict,
    crowd: Crowd | None = None,
) -> Machine:
    """The terms beyond the slice tables, fitted to `runs` (`netpart.calibrate.measure`'s)
    and `link` (bytes per peer, seconds per number of peers), every equation weighted by 1 /
    its measurement (relative errors count: a small model weighs as much as a large one):
    the link tables' overhead from exchange-only runs; the fixed step cost and the saving of
    a joined layer from one-process steps (slices count once: `slice_scale` stays 1), and
    the calibration models' layer tables scaled to those steps (`anchored`); the
    collective, the slowdown of compute and a phase's further cost in a step from two; and
    from `crowd`, the steps at more workers, what they held beyond all that (`crowd_terms`)."""
    terms = _link_terms(link, runs)
    one = [r["one"] for r in runs]
    measured = [x["step_s"] for x in one]
    # One process: step - slices = fixed - saving x joined layers.
    step_fixed, saving = _lstsq(
        [[1.0, -x["joined"]] for x in one],
        [x["step_s"] - x["compute_s"] for x in one],
        measured,
    )
    model = replace(
        base,
        link=terms["link"],
        bandwidth_bps=terms["bandwidth_bps"],
        gather=terms["gather"],
        latency_s=terms["latency_s"],
        step_fixed_s=step_fixed,
        joined_saving_s=saving,
    )
    model = anchored(model, plans, [r["one"]["step_s"] for r in runs], batch)
    # Two: what is left is the collective, compute slowed by sharing the machine, and
    # each exchange phase's cost in a step beyond the exchange-only runs' (into the tables).
    collective, slowdown, per_phase = _two_process_terms(plans, runs, batch, model)
    terms = _link_terms(link, runs, per_phase)
    model = replace(
        model,
        link=terms["link"],
        latency_s=terms["latency_s"],
        bandwidth_bps=terms["bandwidth_bps"],
        collective_s=collective,
        parallel_slowdown=slowdown,
    )
    return replace(model, crowd=crowd_terms(model, crowd, batch)) if crowd else model


def anchored(model: Machine, plans: Plans, one_s: list[float], batch: int) -> Machine:
    """`model` with each calibration model's own layer tables scaled so that its one-process
    step is predicted as measured (`one_s`; the prediction is linear in the tables). The
    step, the median of runs spread over the calibration, moves little from one calibration
    to the next; its slices, timed alone, sum to less than it and move far more
    (docs/planning.md). A layer of several calibration models
    takes the geometric mean of their factors, each held to [ANCHOR_LOW, ANCHOR_HIGH];
    layers of other models, and kinds' tables, are left as they are."""
    factors: dict[str, list[float]] = {}
    for (spec, one, _), step_s in zip(plans, one_s, strict=True):
        keys = set(spec.layer_keys()) & model.layers.keys()
        doubled = {k: model.layers[k].scaled(2.0) for k in keys}
        now = reevaluate(spec, one, batch, model).metrics.predicted_step_s
        tables = reevaluate(spec, one, batch, replace(model, layers={**model.layers, **doubled}))
        part = tables.metrics.predicted_step_s - now  # what its layer tables add to the step
        factor = 1.0 + (step_s - now) / part if part > 0 else 1.0
        for key in keys:
            factors.setdefault(key, []).append(float(np.clip(factor, ANCHOR_LOW, ANCHOR_HIGH)))
    layers = {
        key: cost.scaled(float(np.exp(np.mean(np.log(factors[key]))))) if key in factors else cost
        for key, cost in model.layers.items()
    }
    return replace(model, layers=layers)


def crowd_terms(model: Machine, crowd: Crowd, batch: int) -> tuple:
    """The profile's `crowd`: per number of workers, what its steps held beyond `model`
    (fitted at 2), fitted to seconds per step + a further slowdown of compute (its
    regressor: the prediction's own change per unit of `parallel_slowdown`, so compute off
    the critical path counts only as far as the model puts it on). Either may be negative
    (the two-worker terms may be more than those steps need), down to taking back the
    fitted per-step constants and `parallel_slowdown`."""
    delta, points = 0.01, []
    slower = replace(model, parallel_slowdown=model.parallel_slowdown + delta)
    for workers, cases in sorted(crowd, key=lambda c: c[0]):
        rows, rest, measured = [], [], []
        for spec, p, step_s in cases:
            now = reevaluate(spec, p, batch, model).metrics.predicted_step_s
            then = reevaluate(spec, p, batch, slower).metrics.predicted_step_s
            rows.append([1.0, (then - now) / delta])
            rest.append(step_s - now)
            measured.append(step_s)
        floor = [-(model.collective_s + model.step_fixed_s), -model.parallel_slowdown]
        seconds, slowdown = _lstsq(rows, rest, measured, floor)
        points.append((float(workers), slowdown, seconds))
    return tuple(points)
