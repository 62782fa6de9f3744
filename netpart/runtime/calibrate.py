"""`netpart calibrate`: measure machines into a profile the step-time model can trust.

Five measurements, each with the runtime's own code, at one batch size, over the calibration
models' plans for 1, 2 and 3 workers, on the machines a `Runner` gives (`LocalRunner`: this
one, its workers sharing it; `experiments/validate_sim.py` has emulated dedicated machines).
Every step measurement is the median of `repeats` runs, taken in rounds over every model and
case (a slow spell of the machine then touches one run of each, not every run of one); the
speed probe (`netpart.runtime.speed`) is sampled through every run, and the runs' median
probe is the profile's `probe_s`, against which `netpart run` says how fast the machine ran.

1. Slices: every (layer, worker) slice (of the calibration models and of SLICE_MODELS, whose
   larger layers the tables then reach) run alone with the runtime's slice classes
   (`measure_slices`), the fastest of SLICE_PASSES passes: per layer kind, a table of (FLOPs
   x batch, seconds) points, the seconds per input value a slice gathers where they lower
   the table's error, and the forward pass's median share of a slice.
2. Link: 2 processes (and, where the runner has the machines, up to `LINK_WORLD`) exchanging
   messages of `LINK_SIZES` with every other process, both ways, through the runtime's
   transport (`run_link`): seconds per size and number of peers; and the loss's collective
   among them: seconds per number of workers (the profile's `gather`).
3. Exchange: 2 worker processes running only their programs' messages
   (`run_step(exchange_only=True)`): what a phase costs beyond the link's time for its bytes
   (phases and bytes from each plan's validated schedule), fitted as one overhead per phase
   and added to the link table (the profile's `link`).
4. Steps on 1 process: what the steps hold beyond their slices, fitted to step_fixed_s -
   joined_saving_s x the layers run in one autograd graph with the layer below.
5. Steps on 2 processes: what is left beyond the planner's prediction so far (overlap and
   the measured collective included), fitted to collective_s + parallel_slowdown x compute
   + a cost per exchange phase in a step (added to the link tables).

The result is a `NetworkModel` whose `profile` names the file; `profile_json` adds every
measurement it was fitted to, so a profile can be checked by hand.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from netpart.models import load_spec
from netpart.models.spec import ModelSpec
from netpart.partition import build_unit_graph, plan
from netpart.partition.cost import PROFILE_SCHEMA, KindCost, LayerCost, NetworkModel
from netpart.partition.graph import BYTES_PER_VALUE, UnitGraph
from netpart.partition.planner import PartitionPlan, input_values, reevaluate
from netpart.partition.volume import layer_traffic
from netpart.runtime.check import make_batch
from netpart.runtime.speed import SpeedProbe, probe_once
from netpart.runtime.step import LINK_SIZES, run_link, run_step, timed_steps, warmup_steps
from netpart.runtime.trace import SliceTimes, measure_slices

__all__ = [
    "CALIBRATION_MODELS",
    "SCHEMA_VERSION",
    "SLICE_MODELS",
    "LocalRunner",
    "Runner",
    "calibrate",
    "kind_cost",
    "layer_costs",
    "profile_json",
    "step_cpu_s",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = PROFILE_SCHEMA
LINK_WORLD = 8  # processes: the link is measured with 1 to 7 peers at most
SLICE_PASSES = 2  # every slice is timed in this many passes over the models; the fastest counts
CALIBRATION_S = 0.3  # seconds of timed steps a step measurement covers at least
PROBE_BEFORE = 5  # speed probe samples before a run whose worker this process is
CALIBRATION_MODELS = ("tiny-mlp", "digits-mlp", "tiny-local", "bench-local", "bench-local-wide")
# Models whose slices only are timed: they carry the kinds' tables to the sizes larger models
# use (speech's dense slices of 0.1-4 GFLOP a batch run at 2-3x the FLOP rate of the MLPs' 1-13
# MFLOP ones, which a table extrapolates from otherwise).
SLICE_MODELS = ("speech",)
Progress = Callable[[str], None]


def layer_flops(graph: UnitGraph, p: PartitionPlan) -> np.ndarray:
    """[L, P] forward+backward FLOPs per example of each worker's slice of each layer."""
    flops = np.zeros((len(graph.layers), p.workers), dtype=np.float64)
    np.add.at(flops, (graph.layer_of, p.node_map), graph.flops)
    return flops


def _plan_arrays(spec: ModelSpec, p: PartitionPlan) -> tuple[np.ndarray, ...]:
    """Per example, of each worker's slice of each layer: FLOPs [L, P], the units it sends
    each other worker [L, P, P] (sender, receiver) and the input values it reads [L, P]."""
    graph = build_unit_graph(spec, p.granularity)
    traffic = layer_traffic(graph, p.node_map, p.workers)
    return layer_flops(graph, p), traffic, input_values(graph, p.node_map, p.workers, traffic)


class Runner(Protocol):
    """Where calibration runs: `overlap` says whether each process has a machine of its own
    (the runtime then hides halo behind interior compute); `share` is each machine's share
    of a core (a cpu quota; 1 without one); `slices` times every slice of each plan alone on
    one of those machines; `link` the exchange of each size among `world` of them and their
    loss's collective (`run_link`); `machines` is how many it has; `step` runs a plan's
    workers, one per machine, and returns the median step (seconds, slowest worker) and the
    CPU seconds a step took on its busiest worker, all threads (0 where not recorded).
    `probe_beside`: whether the speed probe may run in this process during a step (false
    where this process is one of the step's workers)."""

    overlap: bool
    machines: int
    share: float
    probe_beside: bool

    def slices(self, spec: ModelSpec, plans: list[PartitionPlan], batch: int) -> list: ...

    def link(
        self, sizes: tuple[int, ...], repeats: int, world: int
    ) -> tuple[np.ndarray, float]: ...

    def step(
        self, spec: ModelSpec, p: PartitionPlan, batch: int, steps: int, exchange_only: bool
    ) -> tuple[float, float]: ...


class LocalRunner:
    """This machine: slices timed in this process, steps in local worker processes that
    share its cores (the runtime does not split layers there). `share`: of a core, where a
    cpu quota holds this process to less than one (a slice then takes at least its CPU time
    / share)."""

    overlap = False
    machines = 2  # more processes than cores measure the cores, not the link
    probe_beside = True

    def __init__(self, share: float = 1.0):
        self.share = share

    def slices(self, spec: ModelSpec, plans: list[PartitionPlan], batch: int) -> list:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [measure_slices(spec, p, batch, share=self.share) for p in plans]
        finally:
            torch.set_num_threads(threads)

    def link(self, sizes: tuple[int, ...], repeats: int, world: int) -> tuple[np.ndarray, float]:
        return run_link(sizes, repeats, world=world)

    def step(self, spec, p, batch, steps, exchange_only=False) -> tuple[float, float]:
        x, y = make_batch(spec, batch, 0)
        warm = warmup_steps(steps)  # a small model settles only after tens of steps
        result = run_step(
            spec, p, x.float(), y, dtype=torch.float32, steps=steps + warm,
            exchange_only=exchange_only,
        )  # fmt: skip
        return float(np.median(result.slowest_steps()[warm:])), step_cpu_s(result.threads, warm)


def step_cpu_s(threads: list[list[dict[str, float]]], warm: int) -> float:
    """The CPU seconds a step takes on the busiest worker: per worker (`threads`: per step,
    each thread group's seconds, `netpart.runtime.profile.thread_usage`) the median over its
    steps after `warm` of all its threads' CPU; 0 where none was recorded."""
    per_worker = [
        float(np.median([sum(v for k, v in s.items() if k.endswith("_cpu_s")) for s in w[warm:]]))
        for w in threads
        if w[warm:]
    ]
    return max(per_worker, default=0.0)


def _fastest(timings: list[SliceTimes]) -> SliceTimes:
    """Per slice, the timing (forward and backward) of the pass whose sum was least."""
    fwd = np.stack([t.forward for t in timings])
    bwd = np.stack([t.backward for t in timings])
    best = np.argmin(fwd + bwd, axis=0)[None]
    fwd, bwd = (np.take_along_axis(a, best, axis=0)[0] for a in (fwd, bwd))
    return SliceTimes(fwd, bwd, timings[0].batch)


def _compute_points(specs, batch: int, runner: Runner, say: Progress) -> tuple[dict, dict]:
    """Per kind, (FLOPs x batch, input values gathered x batch, seconds fwd+bwd, forward
    share) of every slice of 1- to 3-worker plans, and per layer (`ModelSpec.layer_key`),
    (FLOPs x batch, seconds) of its slices: per slice the faster of SLICE_PASSES timings, one
    per pass over all the models (a slow moment of the machine lasts seconds)."""
    plans = {spec.name: [plan(spec, n, "metis", batch=batch) for n in (1, 2, 3)] for spec in specs}
    passes = []
    for k in range(SLICE_PASSES):
        passes.append([runner.slices(spec, plans[spec.name], batch) for spec in specs])
        say(f"slices: pass {k + 1} of {SLICE_PASSES} timed {len(specs)} models")
    points: dict[str, list[tuple[float, float, float, float]]] = {}
    per_layer: dict[str, list[tuple[float, float]]] = {}
    for m, spec in enumerate(specs):
        for i, p in enumerate(plans[spec.name]):
            times = _fastest([timed[m][i] for timed in passes])
            flops, _, values = (a * batch for a in _plan_arrays(spec, p))
            seconds = times.forward + times.backward
            for layer, kind in enumerate(layer.kind for layer in spec.layers):
                for w in np.flatnonzero(flops[layer] > 0):
                    t = seconds[layer, w]
                    points.setdefault(kind, []).append(
                        (flops[layer, w], values[layer, w], t, times.forward[layer, w] / t)
                    )
                    per_layer.setdefault(spec.layer_key(layer), []).append((flops[layer, w], t))
    return points, per_layer


def layer_costs(per_layer: dict[str, list], kinds: dict[str, KindCost]) -> dict[str, LayerCost]:
    """Each layer's own table (`LayerCost`) from its slices, where they have two sizes or
    more, floored at its kind's smallest slice."""
    out = {}
    for key, pts in sorted(per_layer.items()):
        if len({f for f, _ in pts}) > 1:
            floor = float(kinds[key.split()[0]].seconds(np.zeros(1))[0])
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


def _figures(spec: ModelSpec, p: PartitionPlan, batch: int, net: NetworkModel) -> dict:
    """What the fit needs of a plan: the busiest worker's bytes each way in each layer's
    exchange (two phases each: forward and backward), compute by the slice tables alone
    (slowest worker per layer), and its joined layers."""
    flops, traffic, values = _plan_arrays(spec, p)
    busiest = np.maximum(traffic.sum(axis=1), traffic.sum(axis=2)).max(axis=1)
    kinds = [layer.kind for layer in spec.layers]
    keys = [spec.layer_key(i) for i in range(len(kinds))]
    compute = net.worker_compute_s(flops, batch, kinds, values, keys).max(axis=1)
    joined = traffic.sum(axis=(1, 2)) == 0
    return {
        "joined": int(joined[1:].sum()),
        "phase_bytes": [float(b * batch * BYTES_PER_VALUE) for b in busiest if b > 0],
        "compute_s": float(compute.sum()),
    }


def _lstsq(rows: list[list[float]], target: list[float], steps: list[float] | None = None):
    """Non-negative least squares by clamping a negative unknown to 0 and refitting the
    rest; with `steps`, every equation weighted by 1 / its run's step time (relative errors
    count: a small model weighs as much as a large one)."""
    a, t = np.array(rows, dtype=float), np.array(target, dtype=float)
    if steps is not None:
        w = 1.0 / np.maximum(np.array(steps, dtype=float), 1e-12)
        a, t = a * w[:, None], t * w
    sol, *_ = np.linalg.lstsq(a, t, rcond=None)
    if (sol < 0).any():  # refit with the negative one at 0
        keep = sol >= 0
        sol = np.zeros_like(sol)
        sol[keep] = np.linalg.lstsq(a[:, keep], t, rcond=None)[0]
    return [max(float(v), 0.0) for v in sol]


Plans = list[tuple[ModelSpec, PartitionPlan, PartitionPlan]]  # each model's 1- and 2-worker plan


def _runs(plans: Plans, batch: int, steps: int, repeats: int, runner, base, say):
    """Each model's steps on 1 and 2 processes (and 2 exchanging only), with their figures,
    and the median speed probe of the runs (`netpart.runtime.speed`: the machine as it was
    calibrated). The runs go round the models `repeats` times, so a model's runs are spread
    over the whole stage (this machine's slow spells last seconds to minutes and would
    otherwise fall on every run of one model); a case's time is the median of its runs,
    each run's probe recorded beside it. A run times at least `steps` steps and about
    CALIBRATION_S of them (by the slice tables' prediction)."""
    cases = []
    for spec, one, two in plans:
        n_one, n_two = (
            timed_steps(
                reevaluate(spec, p, batch, base).metrics.predicted_step_s, steps, CALIBRATION_S
            )[0]
            for p in (one, two)
        )  # the exchange-only runs take the two-process plan's count
        cases.append({"one": (one, False, n_one), "two": (two, False, n_two),
                      "exchange": (two, True, n_two)})  # fmt: skip
    done = [{key: [] for key in c} for c in cases]  # (seconds, CPU seconds, probe) per run
    for r in range(repeats):
        for (spec, _, _), case, runs_of in zip(plans, cases, done, strict=True):
            for key, (p, exchange_only, count) in case.items():
                runs_of[key].append(_probed_step(runner, spec, p, batch, count, exchange_only))
        say(f"runtime: round {r + 1} of {repeats}: stepped every model on 1 and 2 processes")
    probe = float(np.median([q for runs_of in done for v in runs_of.values() for *_, q in v]))
    runs = []
    for (spec, one, two), runs_of in zip(plans, done, strict=True):
        case = {k: _case(v) for k, v in runs_of.items()}
        runs.append({
            "model": spec.name,
            "one": {**_figures(spec, one, batch, base), **case["one"]},
            "two": {**_figures(spec, two, batch, base), **case["two"],
                    "exchange_s": case["exchange"]["step_s"],
                    "exchange_runs_s": case["exchange"]["runs_s"]},
        })  # fmt: skip
    return runs, probe


def _probed_step(runner: Runner, spec, p, batch, count, exchange_only) -> tuple[float, ...]:
    """(seconds, CPU seconds, probe) of one `runner.step`: the speed probe sampled beside
    the run, or, where this process is one of the run's workers (`probe_beside` false),
    PROBE_BEFORE samples just before it (beside, it would take the worker's CPU)."""
    if runner.probe_beside:
        with SpeedProbe() as probe:
            seconds, cpu = runner.step(spec, p, batch, count, exchange_only)
        return seconds, cpu, probe.median()
    probe = float(np.median([probe_once() for _ in range(PROBE_BEFORE)]))
    return (*runner.step(spec, p, batch, count, exchange_only), probe)


def _case(runs: list[tuple[float, float, float]]) -> dict:
    """A case's runs (seconds, CPU seconds, probe): the medians of seconds and CPU, and
    every run's seconds and probe."""
    seconds, cpu, probes = (list(x) for x in zip(*runs, strict=True))
    return {"step_s": float(np.median(seconds)), "cpu_s": float(np.median(cpu)),
            "runs_s": seconds, "probe_runs_s": probes}  # fmt: skip


def _two_process_terms(plans: Plans, runs, batch: int, model: NetworkModel):
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
        phases = (reevaluate(spec, two, batch, shifted).metrics.predicted_step_s
                  - p.predicted_step_s) / delta  # fmt: skip
        rows.append([1.0, p.compute_s, phases])
        rest.append(run["two"]["step_s"] - p.predicted_step_s)
        measured.append(run["two"]["step_s"])
    collective, slowdown, per_phase = _lstsq(rows, rest, measured)
    return collective, slowdown, per_phase


def _plus(tables: dict, seconds: float) -> dict:
    """Link tables with `seconds` more in every phase."""
    return {k: tuple((b, seconds + t) for b, t in v) for k, v in tables.items()}


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
    one_peer = NetworkModel(link=raw)
    wire = [2.0 * float(one_peer.phase_s(np.array(x["phase_bytes"])).sum()) for x in two]
    exchange = [x["exchange_s"] for x in two]
    rest = [e - w for e, w in zip(exchange, wire, strict=True)]
    (overhead,) = _lstsq([[n] for n in phases], rest, exchange) if any(phases) else [0.0]
    tables = _plus(raw, overhead + in_step)
    b, secs = np.array(tables[1]).T
    latency, per_byte = _lstsq([[1.0, x] for x in b], list(secs), list(secs))
    gather = tuple(sorted((float(n), float(t)) for n, t in link.get("gather_s", {}).items()))
    return {"link": tables, "latency_s": latency, "bandwidth_bps": 8.0 / max(per_byte, 1e-15),
            "gather": gather}  # fmt: skip


def fit(base: NetworkModel, plans: Plans, runs: list[dict], batch: int, link: dict) -> NetworkModel:
    """The terms beyond the slice tables, fitted to `runs` (see `_run`) and `link` (bytes per
    peer, seconds per number of peers), every equation weighted by 1 / its measurement
    (relative errors count: a small model weighs as much as a large one): the link tables'
    overhead from exchange-only runs; the fixed step cost and the saving of a joined layer
    from one-process steps (slices count once: `slice_scale` stays 1); the collective, the
    slowdown of compute and a phase's further cost in a step from two."""
    terms = _link_terms(link, runs)
    one = [r["one"] for r in runs]
    measured = [x["step_s"] for x in one]
    # One process: step - slices = fixed - saving x joined layers.
    step_fixed, saving = _lstsq(
        [[1.0, -x["joined"]] for x in one],
        [x["step_s"] - x["compute_s"] for x in one], measured,
    )  # fmt: skip
    model = replace(
        base, link=terms["link"], bandwidth_bps=terms["bandwidth_bps"], gather=terms["gather"],
        latency_s=terms["latency_s"], step_fixed_s=step_fixed, joined_saving_s=saving,
    )  # fmt: skip
    # Two: what is left is the collective, compute slowed by sharing the machine, and
    # each exchange phase's cost in a step beyond the exchange-only runs' (into the tables).
    collective, slowdown, per_phase = _two_process_terms(plans, runs, batch, model)
    terms = _link_terms(link, runs, per_phase)
    return replace(
        model, link=terms["link"], latency_s=terms["latency_s"],
        bandwidth_bps=terms["bandwidth_bps"], collective_s=collective, parallel_slowdown=slowdown,
    )  # fmt: skip


def calibrate(
    models: tuple[str, ...] = CALIBRATION_MODELS,
    batch: int = 32,
    steps: int = 15,
    say: Progress = log.info,
    runner: Runner | None = None,
    repeats: int = 5,
    slice_models: tuple[str, ...] = SLICE_MODELS,
) -> tuple[NetworkModel, dict]:
    """The calibrated model of the machines `runner` runs on (this one by default), and
    every measurement it was fitted to (`slice_models`: their slices only)."""
    runner = runner or LocalRunner()
    specs = [load_spec(m) for m in models]
    extra = [load_spec(m) for m in slice_models if m not in models]
    points, per_layer = _compute_points(specs + extra, batch, runner, say)
    kinds = {k: kind_cost(v) for k, v in sorted(points.items())}
    layers = layer_costs(per_layer, kinds)
    base = NetworkModel(kinds=kinds, layers=layers, overlap=runner.overlap)
    link = {"sizes": [float(b) for b in LINK_SIZES], "seconds": {}, "gather_s": {}}
    for world in range(2, min(runner.machines, LINK_WORLD) + 1):
        times, gather = runner.link(LINK_SIZES, 10, world)
        seconds = [float(t) for t in times]
        link["seconds"][str(world - 1)] = seconds
        link["gather_s"][str(world)] = float(gather)
        pairs = zip(LINK_SIZES, seconds, strict=True)
        say(
            f"link, {world - 1} peer(s), per peer: "
            + ", ".join(f"{b >> 10} KB {t * 1e3:.2f} ms" for b, t in pairs)
            + f"; the loss's collective {gather * 1e3:.2f} ms"
        )
    plans = [(s, plan(s, 1, "metis", batch=batch), plan(s, 2, "metis", batch=batch)) for s in specs]
    runs, probe = _runs(plans, batch, steps, repeats, runner, base, say)
    model = replace(fit(base, plans, runs, batch, link), probe_s=probe)
    slices = {k: [[float(x) for x in pt] for pt in v] for k, v in sorted(points.items())}
    details = {"batch": batch, "repeats": repeats, "share": runner.share,
               "machines": runner.machines, "overlap": runner.overlap, "slices": slices,
               "link": link, "runs": runs}  # fmt: skip
    return model, details


def profile_json(model: NetworkModel, details: dict) -> str:
    """The profile file: the model (what `--profile` reads) and what it was fitted to."""
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "host": platform.node(),
            "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": model.to_dict(),
            "measurements": details,
        },
        indent=1,
    )
