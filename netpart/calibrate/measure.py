"""`netpart calibrate`: measure machines into a profile the step-time model can trust.

Seven measurements, each with the runtime's own code, at one batch size, over the calibration
models' plans for 1, 2 and 3 workers, on the machines a `Runner` gives (`LocalRunner`: this
one, its workers sharing it; `experiments/validate_sim.py` has emulated dedicated machines).
Every step measurement is the median of `repeats` runs, taken in rounds over every model and
case (a slow spell of the machine then touches one run of each, not every run of one); the
speed probe (`netpart.calibrate.speed`) is sampled through every run, and the runs' median
probe is the profile's `probe_s`, against which `netpart run` says how fast the machine ran.

1. Slices: every (layer, worker) slice (of the calibration models and of SLICE_MODELS, whose
   larger layers the tables then reach) run alone with the runtime's slice classes
   (`measure_slices`), the fastest of SLICE_PASSES passes: per layer kind, a table of (FLOPs
   x batch, seconds) points, the seconds per input value a slice gathers where they lower
   the table's error, and the forward pass's median share of a slice. A conv slice goes to
   the "conv" table where torch's convolution computes most of its outputs, else to the
   `PATCHES` table (tiles and a random cut of models with conv layers are timed for them).
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
6. Steps on more processes, where the runner has the machines (`crowd_counts`: 3, 4, 6, 8 and its
   own count, at most `LINK_WORLD`): what is left beyond all that, per number of workers,
   fitted to seconds per step + a further slowdown of compute (the profile's `crowd`).
   Emulated machines that share one host need it: with 8 of them at 0.2 core stepping, the
   host's kernel spends a third of its cores moving their messages, and compute slows.

7. The parameter server's exchange, where the runner has machines of their own (`ps`: the
   hosts of a torchrun job or a testbed): clients of one shard, and one client of several
   shards, push and fetch, as sync and as Downpour workers do (`netpart.calibrate.pstables`):
   seconds per exchange and the CPU a client spends on one (the profile's `ps`), each size's
   median of passes timed before, between and after the rounds of steps 4-6; then every
   pair again with a stand-in step before each request, as training runs its step
   (`ps.after`); and each calibration model's step as a DDP replica runs it, in this process
   (`netpart.calibrate.ddp_step`, the profile's `ps.replica`).

The fitting itself is `netpart.calibrate.fitting` (pure).

The result is a `Machine` whose `profile` names the file; `netpart.calibrate.profile`
writes it with every measurement it was fitted to, so a profile can be checked by hand.
Between the measurements the machine's load is sampled, each case's runs spread recorded and,
last, the model's predictions set against measured steps of the calibration models and of
one model it was not fitted on (`check_model`); `netpart.calibrate.trust` judges them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Protocol

import numpy as np
import torch

from netpart.calibrate import CALIBRATION_MODELS, CHECK_MODEL, SLICE_MODELS
from netpart.calibrate.ddp_step import replica_steps
from netpart.calibrate.fitting import Crowd, Plans, fit, kind_cost, layer_costs, with_link
from netpart.calibrate.pstables import PsTables, per_size
from netpart.calibrate.speed import SpeedProbe, probe_once
from netpart.calibrate.trace import SliceTimes, measure_slices
from netpart.calibrate.trust import LoadSample, sample
from netpart.cost.exchange import PsExchange
from netpart.cost.machine import PATCHES, PROFILE_SCHEMA, Machine
from netpart.models import load_spec
from netpart.models.spec import BYTES_PER_VALUE, ModelSpec
from netpart.partition import build_unit_graph, plan
from netpart.partition.evaluate import convolved_shares, input_values, reevaluate
from netpart.partition.graph import UnitGraph
from netpart.partition.plans import PartitionPlan
from netpart.partition.volume import layer_traffic
from netpart.runtime.check import make_batch
from netpart.runtime.step import (
    LINK_SIZES,
    StepOptions,
    run_link,
    run_step,
    timed_steps,
    warmup_steps,
)

__all__ = [
    "CALIBRATION_MODELS",
    "CHECK_MODEL",
    "PROBE_SWING",
    "SCHEMA_VERSION",
    "SLICE_MODELS",
    "LocalRunner",
    "Runner",
    "calibrate",
    "crowd_counts",
    "fit",
    "kind_cost",
    "layer_costs",
    "run_spreads",
    "slice_points",
    "step_cpu_s",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = PROFILE_SCHEMA
LINK_WORLD = 8  # processes: the link is measured with 1 to 7 peers at most
SLICE_PASSES = 2  # every slice is timed in this many passes over the models; the fastest counts
CALIBRATION_S = 0.3  # seconds of timed steps a step measurement covers at least
PROBE_BEFORE = 5  # speed probe samples before a run whose worker this process is
# The probe's 90th over its 10th percentile across the runs above which `netpart calibrate`
# warns that the machine's speed moved while it was calibrated.
PROBE_SWING = 1.25
LOAD_SAMPLE_S = 0.5  # seconds the machine's load is sampled between measurements
Progress = Callable[[str], None]


def layer_flops(graph: UnitGraph, p: PartitionPlan) -> np.ndarray:
    """[L, P] forward+backward FLOPs per example of each worker's slice of each layer."""
    flops = np.zeros((len(graph.layers), p.workers), dtype=np.float64)
    np.add.at(flops, (graph.layer_of, p.node_map), graph.flops)
    return flops


def _plan_arrays(spec: ModelSpec, p: PartitionPlan) -> tuple[np.ndarray, ...]:
    """Per example, of each worker's slice of each layer: FLOPs [L, P], the units it sends
    each other worker [L, P, P] (sender, receiver), the input values it reads [L, P] and the
    share of its outputs torch's convolution computes [L, P] (conv layers)."""
    graph = build_unit_graph(spec, p.granularity)
    traffic = layer_traffic(graph, p.node_map, p.workers)
    values = input_values(graph, p.node_map, p.workers, traffic)
    convolved = convolved_shares(graph, p.node_map, p.workers)
    return layer_flops(graph, p), traffic, values, convolved


class Runner(Protocol):
    """Where calibration runs: `overlap` says whether each process has a machine of its own
    (the runtime then hides halo behind interior compute); `share` is each machine's share
    of a core (a cpu quota; 1 without one); `slices` times every slice of each plan alone on
    one of those machines; `link` the exchange of each size among `world` of them and their
    loss's collective (`run_link`); `machines` is how many it has; `step` runs a plan's
    workers, one per machine, and returns the median step (seconds, slowest worker) and the
    CPU seconds a step took on its busiest worker, all threads (0 where not recorded).
    `probe_beside`: whether the speed probe may run in this process during a step (false
    where this process is one of the step's workers). A runner whose machines are its own may
    also have `ps(mode, clients, sizes, repeats, shards=1, stand_in=0.0)` (`HostsRunner`):
    (seconds, CPU seconds) per exchange of the parameter server's clients (`stand_in`: CPU
    seconds of a step each client runs before each request); `calibrate` measures it where
    it exists."""

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
        options = StepOptions(dtype="float32", steps=steps + warm, exchange_only=exchange_only)
        result = run_step(spec, p, x.float(), y, options)
        return float(np.median(result.slowest_steps()[warm:])), step_cpu_s(result.threads, warm)


def step_cpu_s(threads: list[list[dict[str, float]]], warm: int) -> float:
    """The CPU seconds a step takes on the busiest worker: per worker (`threads`: per step,
    each thread group's seconds, `netpart.runtime.breakdown.thread_usage`) the median over its
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


def slice_points(specs, batch: int, runner: Runner, say: Progress) -> tuple[dict, dict]:
    """Per kind, (FLOPs x batch, input values gathered x batch, seconds fwd+bwd, forward
    share) of every slice of 1- to 3-worker plans, and per layer (`ModelSpec.layer_key`),
    (FLOPs x batch, seconds) of its slices: per slice the faster of SLICE_PASSES timings, one
    per pass over all the models (a slow moment of the machine lasts seconds)."""
    plans = {spec.name: _slice_plans(spec, batch) for spec in specs}
    passes = []
    for k in range(SLICE_PASSES):
        passes.append([runner.slices(spec, plans[spec.name], batch) for spec in specs])
        say(f"slices: pass {k + 1} of {SLICE_PASSES} timed {len(specs)} models")
    points: dict[str, list[tuple[float, float, float, float]]] = {}
    per_layer: dict[str, list[tuple[float, float]]] = {}
    for m, spec in enumerate(specs):
        for i, p in enumerate(plans[spec.name]):
            times = _fastest([timed[m][i] for timed in passes])
            flops, _, values, convolved = _plan_arrays(spec, p)
            flops, values = flops * batch, values * batch
            seconds = times.forward + times.backward
            for layer, kind in enumerate(layer.kind for layer in spec.layers):
                for w in np.flatnonzero(flops[layer] > 0):
                    t = seconds[layer, w]
                    path = PATCHES if kind == "conv" and convolved[layer, w] < 0.5 else kind
                    points.setdefault(path, []).append(
                        (flops[layer, w], values[layer, w], t, times.forward[layer, w] / t)
                    )
                    if path != PATCHES:  # a layer's own table: what its whole slices run
                        key = spec.layer_key(layer)
                        per_layer.setdefault(key, []).append((flops[layer, w], t))
    return points, per_layer


def _slice_plans(spec: ModelSpec, batch: int) -> list[PartitionPlan]:
    """The plans whose slices calibration times: METIS over 1, 2 and 3 workers, and for a
    model with conv layers tiles over 2 and 3 (their rectangles convolve: the "conv" table)
    and a random cut over 2 (its slices multiply gathered patches: the `PATCHES` table)."""
    plans = [plan(spec, n, "metis", batch=batch) for n in (1, 2, 3)]
    if any(layer.kind == "conv" for layer in spec.layers):
        plans += [plan(spec, n, "tiles", batch=batch) for n in (2, 3)]
        plans.append(plan(spec, 2, "random", batch=batch))
    return plans


def _figures(spec: ModelSpec, p: PartitionPlan, batch: int, net: Machine) -> dict:
    """What the fit needs of a plan: the busiest worker's bytes each way in each layer's
    exchange (two phases each: forward and backward), compute by the slice tables alone
    (slowest worker per layer), and its joined layers."""
    flops, traffic, values, convolved = _plan_arrays(spec, p)
    busiest = np.maximum(traffic.sum(axis=1), traffic.sum(axis=2)).max(axis=1)
    kinds = [layer.kind for layer in spec.layers]
    keys = spec.layer_keys()
    compute = net.worker_compute_s(flops, batch, kinds, values, keys, convolved=convolved)
    compute = compute.max(axis=1)
    joined = traffic.sum(axis=(1, 2)) == 0
    return {
        "joined": int(joined[1:].sum()),
        "phase_bytes": [float(b * batch * BYTES_PER_VALUE) for b in busiest if b > 0],
        "compute_s": float(compute.sum()),
    }


def crowd_counts(machines: int) -> list[int]:
    """The worker counts above 2 that calibration steps on `machines`: 3, 4, 6, 8 (each at
    most 1.5x the one before, so that reading between two of them stays close) and
    `machines` itself, up to LINK_WORLD."""
    top = min(machines, LINK_WORLD)
    return sorted({n for n in (3, 4, 6, 8, top) if 2 < n <= top})


def _runs(
    plans: Plans,
    wide: dict,
    batch: int,
    steps: int,
    repeats: int,
    runner,
    models: tuple[Machine, Machine],
    say,
    load: list[LoadSample],
    between: Callable[[int], None],
):
    """Each model's steps on 1 and 2 processes (and 2 exchanging only; and on each count of
    `wide`: {workers: each model's plan}), with their figures, and the speed probe of
    every run (`netpart.calibrate.speed`: the machine as it was calibrated). The runs go
    round the models `repeats` times, so a model's runs are spread over the whole stage (this
    machine's slow spells last seconds to minutes and would otherwise fall on every run of
    one model); a case's time is the median of its runs, each run's probe recorded beside
    it. `models`: the slice tables (each run's figures), and the same with the measured link,
    whose prediction sizes a run: at least `steps` steps and about CALIBRATION_S of them.
    `between`: called after each round with the rounds done (the parameter server's
    passes)."""
    base, sized_by = models

    def count(spec, p) -> int:
        predicted = reevaluate(spec, p, batch, sized_by).metrics.predicted_step_s
        return timed_steps(predicted, steps, CALIBRATION_S)[0]

    cases = []
    for spec, one, two in plans:
        n_two = count(spec, two)  # the exchange-only runs take the two-process plan's count
        cases.append(
            {
                "one": (one, False, count(spec, one)),
                "two": (two, False, n_two),
                "exchange": (two, True, n_two),
            }
        )
    for n, wide_plans in wide.items():
        for (spec, *_), case, p in zip(plans, cases, wide_plans, strict=True):
            case[n] = (p, False, count(spec, p))
    done = [{key: [] for key in c} for c in cases]  # (seconds, CPU seconds, probe) per run
    for r in range(repeats):
        for (spec, _, _), case, runs_of in zip(plans, cases, done, strict=True):
            for key, (p, exchange_only, count) in case.items():
                runs_of[key].append(_probed_step(runner, spec, p, batch, count, exchange_only))
        counts = "/".join(str(n) for n in (1, 2, *wide))
        load.append(sample(LOAD_SAMPLE_S))  # the machine while calibration runs nothing
        say(
            f"runtime: round {r + 1} of {repeats}: stepped every model on {counts} processes "
            f"({load[-1].describe()})"
        )
        between(r + 1)
    probes = [q for runs_of in done for v in runs_of.values() for *_, q in v]
    return _figured_runs(plans, done, wide, batch, base), probes


def _figured_runs(plans: Plans, done: list[dict], wide: dict, batch: int, base) -> list[dict]:
    """Each model's cases (`done`: its runs per case) with the figures of their plans."""
    runs = []
    for (spec, one, two), runs_of in zip(plans, done, strict=True):
        case = {k: _case(v) for k, v in runs_of.items()}
        runs.append(
            {
                "model": spec.name,
                "one": {**_figures(spec, one, batch, base), **case["one"]},
                "two": {
                    **_figures(spec, two, batch, base),
                    **case["two"],
                    "exchange_s": case["exchange"]["step_s"],
                    "exchange_runs_s": case["exchange"]["runs_s"],
                },
                "crowd": {str(n): case[n] for n in wide},
            }
        )
    return runs


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
    return {
        "step_s": float(np.median(seconds)),
        "cpu_s": float(np.median(cpu)),
        "runs_s": seconds,
        "probe_runs_s": probes,
    }


def _plans(specs: list[ModelSpec], batch: int, machines: int) -> tuple[Plans, dict]:
    """Each model's plans on 1 and 2 workers, and on each count `crowd_counts` gives."""
    plans = [(s, plan(s, 1, "metis", batch=batch), plan(s, 2, "metis", batch=batch)) for s in specs]
    wide = {n: [plan(s, n, "metis", batch=batch) for s in specs] for n in crowd_counts(machines)}
    return plans, wide


def _crowd(specs: list[ModelSpec], wide: dict, runs: list[dict]) -> Crowd:
    """Per worker count above 2: each model, its plan and its measured step."""
    return [
        (n, [(s, p, r["crowd"][str(n)]["step_s"]) for s, p, r in zip(specs, ps, runs, strict=True)])
        for n, ps in wide.items()
    ]


def calibrate(
    models: tuple[str, ...] = CALIBRATION_MODELS,
    batch: int = 32,
    steps: int = 15,
    say: Progress = log.info,
    runner: Runner | None = None,
    repeats: int = 5,
    slice_models: tuple[str, ...] = SLICE_MODELS,
    check_model: str | None = CHECK_MODEL,
    ps_largest: float | None = None,
) -> tuple[Machine, dict]:
    """The calibrated model of the machines `runner` runs on (this one by default), and
    every measurement it was fitted to (`slice_models`: their slices only), the machine's
    load between measurements, each case's runs' spread, and the model's predictions
    against measured steps (`check_model`: also one model it was not fitted on);
    `ps_largest`: the parameter server's largest exchange timed (bytes; None: PS_SIZES')."""
    runner = runner or LocalRunner()
    load = [sample(LOAD_SAMPLE_S)]
    specs = [load_spec(m) for m in models]
    extra = [load_spec(m) for m in slice_models if m not in models]
    base, slices = _slice_machine(specs + extra, batch, runner, say)
    link, wire_bps = _link(runner, say)
    # the parameter server's first pass now, the others between and after the steps' rounds
    ps_timer = PsTables(runner, say, wire_bps=wire_bps, runs=repeats, largest=ps_largest)
    ps_timer.time_pass()
    ps_timer.time_after()
    plans, wide = _plans(specs, batch, runner.machines)
    between = ps_timer.between_rounds(repeats)
    models = (base, with_link(base, link))  # a run's figures; its length, before it is timed
    runs, probes = _runs(plans, wide, batch, steps, repeats, runner, models, say, load, between)
    ps, ps_raw = ps_timer.result()
    if ps_raw is not None:  # machines of its own: a DDP replica's step too, on one of them
        ps_raw["replica"] = replica_steps(
            specs, batch=batch, steps=steps, seconds=CALIBRATION_S, runs=repeats, say=say
        )
        ps = PsExchange.from_dict(ps_raw)
    probe = float(np.median(probes))
    crowd = _crowd(specs, wide, runs)
    model = replace(fit(base, plans, runs, batch, link, crowd), probe_s=probe, ps=ps)
    check = _check(plans, runs, model, batch, (runner, steps, repeats), check_model)
    details = {
        "batch": batch,
        "repeats": repeats,
        "share": runner.share,
        "machines": runner.machines,
        "overlap": runner.overlap,
        "slices": slices,
        "link": link,
        "runs": runs,
        "anchored": _anchors(specs, base, model),
        "probe_spread": [float(np.percentile(probes, q) / probe) for q in (10, 90)],
        "load": [asdict(x) for x in load],
        "run_spreads": run_spreads(runs),
        "check": check,
        "ps": ps_raw,
    }
    return model, details


def _slice_machine(specs, batch: int, runner: Runner, say: Progress) -> tuple[Machine, dict]:
    """The machine of the slice tables alone (per kind, and per layer timed at two sizes or
    more), and the points they were made of, as the profile records them."""
    points, per_layer = slice_points(specs, batch, runner, say)
    kinds = {k: kind_cost(v) for k, v in sorted(points.items())}
    base = Machine(kinds=kinds, layers=layer_costs(per_layer, kinds), overlap=runner.overlap)
    slices = {k: [[float(x) for x in pt] for pt in v] for k, v in sorted(points.items())}
    return base, slices


def _link(runner: Runner, say: Progress) -> tuple[dict, float]:
    """The profile's `link` measurements (each size among 2 to `LINK_WORLD` of the runner's
    machines, and the loss's collective among them) and the link's rate in bits a second
    (one peer, each way at once; 0 with one machine)."""
    link = {"sizes": [float(b) for b in LINK_SIZES], "seconds": {}, "gather_s": {}}
    for world in range(2, min(runner.machines, LINK_WORLD) + 1):
        times, gather = runner.link(LINK_SIZES, 10, world)
        seconds = [float(t) for t in times]
        link["seconds"][str(world - 1)] = seconds
        link["gather_s"][str(world)] = float(gather)
        say(
            f"link, {world - 1} peer(s), per peer: {per_size(LINK_SIZES, seconds)}; the "
            f"loss's collective {gather * 1e3:.2f} ms"
        )
    one = link["seconds"].get("1")
    return link, 8 * LINK_SIZES[-1] / one[-1] if one else 0.0


def run_spreads(runs: list[dict]) -> list[float]:
    """Each step case's slowest run over its fastest (one, two, exchange, crowd)."""
    out = []
    for r in runs:
        cases = [r["one"]["runs_s"], r["two"]["runs_s"], r["two"]["exchange_runs_s"]]
        cases += [c["runs_s"] for c in r["crowd"].values()]
        out += [max(c) / min(c) for c in cases if c and min(c) > 0]
    return out


def _check(
    plans: Plans, runs: list[dict], model: Machine, batch: int, how, check_model: str | None
) -> list[dict]:
    """Predicted against measured steps: the calibration models' (their runs) and, on 1 and
    2 processes, `check_model`'s, which the model was not fitted on (its median of
    `repeats` runs)."""
    rows = []
    for (spec, one, two), r in zip(plans, runs, strict=True):
        for p, case in ((one, r["one"]), (two, r["two"])):
            predicted = reevaluate(spec, p, batch, model).metrics.predicted_step_s
            rows.append(
                {
                    "model": spec.name,
                    "workers": p.workers,
                    "fitted": True,
                    "predicted_s": predicted,
                    "measured_s": case["step_s"],
                }
            )
    if check_model is None:
        return rows
    runner, steps, repeats = how
    spec = load_spec(check_model)
    for workers in (1, 2):
        p = plan(spec, workers, "metis", batch=batch)
        predicted = reevaluate(spec, p, batch, model).metrics.predicted_step_s
        count = timed_steps(predicted, steps, CALIBRATION_S)[0]
        measured = float(np.median([runner.step(spec, p, batch, count)[0] for _ in range(repeats)]))
        rows.append(
            {
                "model": spec.name,
                "workers": workers,
                "fitted": False,
                "predicted_s": predicted,
                "measured_s": measured,
            }
        )
    return rows


def _anchors(specs: list[ModelSpec], base: Machine, model: Machine) -> dict:
    """Per calibration model, the median factor its layer tables were scaled by
    (`fitting.anchored`): its one-process step against its slices timed alone."""
    out = {}
    for spec in specs:
        keys = set(spec.layer_keys()) & base.layers.keys()
        ratios = [model.layers[k].points[0][1] / base.layers[k].points[0][1] for k in keys]
        if ratios:
            out[spec.name] = float(np.median(ratios))
    return out
