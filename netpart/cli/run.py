"""`netpart run | check`: a partitioned model in N worker processes, timed or checked."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from netpart.cli.common import (
    add_launch_args,
    add_profile_arg,
    byte_size,
    check_writable,
    echo,
    per_worker_stats,
    plan_for_run,
    positive_int,
    timeout_s,
)
from netpart.cli.testbed import add_testbed_arg
from netpart.cost.sheet import load_machine
from netpart.files import write_atomic
from netpart.processes.memory import available_memory

__all__ = ["register"]

QUIET_TRIES = 3  # samples of 2 s before a calibration starts, waiting for a busy machine


def register(sub) -> None:
    """Add `run` and `check` to the subcommands."""
    r = sub.add_parser(
        "run",
        help="time partitioned steps in N processes against the plan's prediction",
        description="Run STEPS forward/backward steps of MODEL partitioned across WORKERS "
        "processes (torch.distributed, gloo; weights are not updated) and report the measured "
        "step time (slowest worker, median after warm-up) next to the plan's predicted step "
        "time, the per-layer compute and exchange time, and the bytes moved.",
    )
    add_launch_args(r, batch=32, stats_help="write the measurements as JSON")
    r.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="timed steps (default: at least 10, and about 0.5 s of steps by the prediction)",
    )
    r.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker")
    r.add_argument(
        "--split",
        action="store_true",
        help="hide halo exchange behind interior compute in the layers where the plan says "
        "it pays (the table's split column; on by default only when a replica's workers are "
        "on different hosts: on one host it costs what it hides)",
    )
    r.add_argument(
        "--no-overlap",
        action="store_true",
        help="neither split nor join layers (to measure what they change)",
    )
    r.add_argument(
        "--breakdown",
        action="store_true",
        help="also print where each worker's step goes (slice, fill, post, wait, loss, other) "
        "and its threads' CPU and run-queue wait per step",
    )
    add_profile_arg(r)

    c = sub.add_parser(
        "check",
        help="run one partitioned step in N processes and compare it with the reference",
        description="Run one forward/backward step of MODEL partitioned across WORKERS processes "
        "(torch.distributed, gloo) and the same step on the single-process reference in "
        "float64; print the largest differences of loss, outputs and every parameter gradient "
        "and the bytes each layer moved against the plan. Exit 0 only when all agree.",
    )
    add_launch_args(c, batch=4, stats_help="write bytes per layer/worker as JSON")
    c.add_argument(
        "--tolerance", type=float, default=1e-9, help="abs and rel tolerance (default 1e-9)"
    )
    c.add_argument(
        "--show-schedule",
        action="store_true",
        help="print each worker's program (the instructions its process runs) before checking",
    )
    r.set_defaults(func=cmd_run, torch=True)
    add_testbed_arg(c, processes=lambda args: args.workers)
    c.set_defaults(func=cmd_check, torch=True)
    _calibrate_parser(sub)


def _calibrate_parser(sub) -> None:
    from netpart.calibrate import CALIBRATION_MODELS, SLICE_MODELS

    k = sub.add_parser(
        "calibrate",
        help="measure this machine into a profile for `plan|run|train --profile`",
        description="Time every layer kind's slices (the runtime's own slice classes) against "
        "their FLOPs, the link between 2 processes per message size, the runtime's exchanges "
        "between 2 worker processes against their bytes, and whole steps on 1 and 2 processes "
        "(each the median of --repeats runs); fit the step-time model's figures to them and "
        "write a profile (JSON: the model, and every measurement it was fitted to). Takes a "
        "few minutes; run it on an idle machine. Started by torchrun with one process per "
        "host (`torchrun --nnodes H --nproc-per-node 1 ... -m netpart calibrate`), it "
        "measures the link among the hosts and steps with one worker per host (layers split "
        "as across machines); rank 0 times the slices on its host and writes the profile. "
        "Layers larger than any timed slice are extrapolated: to plan a model whose layers "
        "are far larger than the calibration models', add it to --slice-models.",
    )
    k.add_argument("--out", type=Path, default=Path("profile.json"), help="profile file to write")
    k.add_argument(
        "--models",
        default=",".join(CALIBRATION_MODELS),
        help=f"zoo models to measure (default {','.join(CALIBRATION_MODELS)})",
    )
    k.add_argument(
        "--slice-models",
        default=",".join(SLICE_MODELS),
        help="zoo models whose slices only are timed, so that the tables reach larger layers "
        f"('' for none; default {','.join(SLICE_MODELS)})",
    )
    k.add_argument("--batch", type=positive_int, default=32, help="examples per step (default 32)")
    k.add_argument(
        "--steps",
        type=positive_int,
        default=15,
        help="timed steps per run at least (and about 0.3 s of them; default 15)",
    )
    k.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="runs of each step measurement (median; default 5); the parameter server's "
        "exchanges are timed as often in proportion (fewer: a quicker, noisier calibration)",
    )
    _host_args(k)
    _trust_args(k)
    add_testbed_arg(k)
    k.set_defaults(func=cmd_calibrate, torch=True)


def _host_args(k: argparse.ArgumentParser) -> None:
    """Where a calibration runs: torchrun's hosts (their messages, the parameter server's
    exchanges between them) and a machine held to a share of a core."""
    k.add_argument(
        "--timeout",
        type=timeout_s,
        default=120.0,
        help="under torchrun: seconds a host waits for a peer's message (default 120)",
    )
    k.add_argument(
        "--ps-up-to",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="under torchrun: time the parameter server's exchanges up to SIZE (e.g. 16MB; "
        "default all, to 40 MB); larger ones are priced off the table's last segment: "
        "a quicker calibration for models whose exchanges are smaller",
    )
    k.add_argument(
        "--share",
        type=float,
        default=1.0,
        help="each process's share of a core where a cpu quota (a container's cgroup) holds it "
        "below one: a slice then takes at least its CPU time / share (default 1)",
    )


def _trust_args(k: argparse.ArgumentParser) -> None:
    """What a calibration is checked on, and whether a busy machine's is kept."""
    from netpart.calibrate import CHECK_MODEL

    k.add_argument(
        "--check-model",
        default=CHECK_MODEL,
        help="a zoo model the fit is checked on, not fitted on: its steps on 1 and 2 "
        "processes against the prediction ('' for none)",
    )
    k.add_argument(
        "--force",
        action="store_true",
        help="keep a calibration of a busy machine, the first one made (without it one is "
        "repeated once, then refused: other processes' load, a hypervisor's steal, repeated "
        "runs far apart, implausible fitted terms); the profile and every prediction made "
        "with it say so",
    )


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch.distributed

    from netpart.calibrate.measure import LocalRunner
    from netpart.calibrate.profile import check_lines, host_machine, profile_json, profile_lines
    from netpart.cost.sheet import sheet_toml
    from netpart.errors import PlanError
    from netpart.models import load_spec
    from netpart.runtime.check import require_memory, under_torchrun

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    extra = tuple(m.strip() for m in args.slice_models.split(",") if m.strip())
    if not models:
        raise PlanError(f"--models {args.models!r}: name at least one zoo model to calibrate on")
    for m in models + extra + ((args.check_model,) if args.check_model else ()):
        require_memory(load_spec(m), args.batch, "calibrating on")  # before minutes of work
    check_writable(args.out, "--out")
    if not 0 < args.share <= 1:
        raise PlanError(f"--share is a fraction of one core (0 < share <= 1), got {args.share}")
    runner = LocalRunner(args.share)
    if under_torchrun():  # one process per host: the link and steps between the hosts
        from netpart.calibrate.hosts import HostsRunner

        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise PlanError(
                "netpart calibrate under torchrun measures between machines: start one "
                "process on each of at least 2 (torchrun --nnodes K --nproc-per-node 1)"
            )

        runner = HostsRunner(args.timeout, args.share)
        if runner.rank != 0:
            runner.follow()
            return 0
    try:
        model, details = _trusted_calibration(args, models, extra, runner)
    except BaseException:
        if torch.distributed.is_initialized():  # the followers see the group close and stop
            torch.distributed.destroy_process_group()
        raise
    if torch.distributed.is_initialized():  # the all-reduce last, every rank out of its groups
        from dataclasses import replace

        from netpart.calibrate.pstables import ring_plan, with_rings

        rings = runner.close(ring_plan(details["ps"], args.repeats))
        if rings:
            ps, details["ps"] = with_rings(details["ps"], rings, echo)
            model = replace(model, ps=ps)
    write_atomic(args.out, profile_json(model, details).encode())
    machine = args.out.with_suffix(".machine.toml")
    write_atomic(machine, sheet_toml(host_machine(model)).encode())
    for line in profile_lines(model, details) + check_lines(details):
        echo(line)
    if model.caveat:
        echo(f"warning: kept with --force: {model.caveat}")
    echo(f"wrote {args.out}; use it with `netpart plan|run|train --profile {args.out}`")
    echo(f"wrote {machine}: this host's description in absolute figures (`--machine`)")
    return 0


def _trusted_calibration(args, models, extra, runner):
    """Calibrate when the machine is quiet; judge the result (`netpart.calibrate.trust`);
    repeat an untrusted one once, then refuse it; with --force keep the first, marked (its
    user accepted a busy machine: a second pass would double the minutes and fit the same
    load)."""
    from dataclasses import replace

    from netpart.calibrate.measure import calibrate, run_spreads
    from netpart.calibrate.trust import LoadSample, sample, verdict
    from netpart.errors import CalibrationError

    for _ in range(QUIET_TRIES):  # before minutes of measuring: is anyone else busy?
        if not (now := sample(2.0)).busy():
            break
        echo(f"the machine is busy ({now.describe()}); waiting for it to quiet down")
    else:
        if not args.force:
            raise CalibrationError(
                f"the machine stayed busy ({now.describe()}): a calibration now would fit "
                "that load; calibrate when it is quiet, or keep one anyway with --force"
            )
    attempts = 1 if args.force else 2  # --force: its user accepted a busy machine
    for attempt in range(attempts):
        model, details = calibrate(
            models,
            args.batch,
            args.steps,
            say=echo,
            repeats=args.repeats,
            slice_models=extra,
            runner=runner,
            check_model=args.check_model or None,
            ps_largest=args.ps_up_to,
        )
        load = [LoadSample(**x) for x in details["load"]]
        judged = verdict(load, run_spreads(details["runs"]), model)
        details["verdict"] = list(judged.reasons)
        if judged.trusted:
            return model, details
        echo("this calibration cannot be trusted: " + "; ".join(judged.reasons))
        if attempt + 1 < attempts:
            echo("calibrating again")
    if not args.force:
        raise CalibrationError(
            f"calibrated twice on a busy machine ({judged.reasons[0]}); calibrate when it is "
            "quiet, or keep the profile anyway with --force (it is then marked as such)"
        )
    return replace(model, caveat=judged.caveat()), details


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from netpart.calibrate.speed import SLOW_SPELL, SpeedProbe
    from netpart.runtime.check import make_batch
    from netpart.runtime.step import StepOptions, run_step, timed_steps

    spec, p, network = _run_plan(args)
    x, y = make_batch(spec, args.batch, args.seed)
    if args.steps is None:
        steps, warmup = timed_steps(p.metrics.predicted_step_s)
    else:
        steps, warmup = args.steps, min(3, args.steps - 1) if args.steps > 1 else 0
    with SpeedProbe() as probe:
        options = StepOptions(
            seed=args.seed,
            dtype="float32",
            timeout=args.timeout,
            threads=args.threads,
            steps=steps + warmup,
            overlap=not args.no_overlap,
            split=args.split,
        )
        result = run_step(spec, p, x.float(), y, options)
    per_step = result.slowest_steps()[warmup:]
    measured = float(np.median(per_step))
    predicted = p.metrics.predicted_step_s
    echo(
        f"{spec.name} on {args.workers} worker processes ({p.method}), batch {args.batch}, "
        f"{args.threads} thread(s) each: step {measured * 1e3:.1f} ms (median of {len(per_step)}; "
        f"predicted {predicted * 1e3:.1f} ms, {measured / predicted:.2f}x, from the "
        f"{p.network.describe()})"
    )
    slowdown = probe.median() / network.probe_s if network.probe_s else None
    if slowdown is not None:
        spell = " (a slow spell: the prediction is for the machine as calibrated)"
        echo(
            f"speed probe during the run: {slowdown:.2f}x its median while the profile was "
            f"calibrated{spell if slowdown > SLOW_SPELL else ''}"
        )
    _layer_table(spec, result, p if args.split and not args.no_overlap else None)
    if args.breakdown:
        _breakdown_table(result, warmup)
    sent = sum(v for s in result.sent for v in s.values())
    echo(f"bytes moved per step: {sent:,} (plan: {2 * p.metrics.volume * args.batch * 4:,})")
    if args.stats is not None:
        stats = {
            "step_s": per_step.tolist(),
            "step_s_median": measured,
            "predicted_step_s": predicted,
            "probe_s": probe.median(),
            "slowdown": slowdown,
            "per_worker": per_worker_stats(result),
        }
        write_atomic(args.stats, json.dumps(_run_stats(args, p) | stats, indent=1).encode())
    return 0


def _run_stats(args: argparse.Namespace, p) -> dict:
    """What `netpart run --stats` records of the run's set-up."""
    return {
        "model": p.model,
        "workers": args.workers,
        "method": p.method,
        "batch": args.batch,
        "threads": args.threads,
        "overlap": not args.no_overlap,
        "split": args.split,
        "prediction": p.network.describe(),
    }


def _run_plan(args: argparse.Namespace):
    """(spec, plan, network) of `netpart run`: the plan predicted for this run's workers,
    which share this machine (the runtime hides halo only with --split)."""
    from dataclasses import replace

    from netpart.partition import plan
    from netpart.partition.evaluate import reevaluate

    spec, p = plan_for_run(args)
    network = replace(load_machine(args.profile, machine=args.machine), overlap=args.split)
    p = p or plan(
        spec,
        args.workers,
        args.method,
        seed=args.seed,
        batch=args.batch,
        network=network,
        memory=available_memory(),
    )
    if p.network != network or p.batch != args.batch:  # the prediction for this run
        p = reevaluate(spec, p, args.batch, network)
    return spec, p, network


def _layer_table(spec, result, split_plan=None) -> None:
    """Per layer, the slowest worker's compute, exposed exchange (posting and waiting) and
    hidden exchange (in flight while it computed), forward + backward, in the last step; and
    with `split_plan` (layers split), whether the plan splits it."""
    from netpart.planning.report import split_label

    echo(
        f"{'layer':<10} {'compute ms':>11} {'exposed ms':>11} {'hidden ms':>10} {'split':>14}"
        "  (exchange; slowest worker, last step)"
    )

    def both(d: dict, i: int) -> float:
        return d.get((i, "forward"), 0.0) + d.get((i, "backward"), 0.0)

    for i in range(len(spec.layers)):
        comp = max(both(c, i) for c in result.compute_s)
        exposed = max(both(e, i) for e in result.exchange_s)
        hidden = max(both(h, i) for h in result.hidden_s) if result.hidden_s else 0.0
        split = split_label(split_plan.layers[i]) if split_plan else "off (one host)"
        echo(
            f"{spec.layer_name(i):<10} {comp * 1e3:>11.2f} {exposed * 1e3:>11.2f} "
            f"{hidden * 1e3:>10.2f} {split:>14}"
        )
    loss = max(e.get((len(spec.layers), "loss"), 0.0) for e in result.exchange_s)
    echo(f"{'loss':<10} {'':>11} {loss * 1e3:>11.2f}")


def _breakdown_table(result, warmup: int) -> None:
    """Per worker: median ms per step by category, and its threads' CPU per step."""
    from netpart.runtime.breakdown import step_breakdown, thread_medians

    echo(f"\n{'worker':<7}" + "".join(f"{k:>9}" for k in (*BREAKDOWN_COLUMNS, "step")))
    for w, (times, breakdowns) in enumerate(zip(result.step_times, result.breakdowns, strict=True)):
        prof = step_breakdown(times[warmup:], breakdowns[warmup:])
        echo(f"{w:<7}" + "".join(f"{prof[k] * 1e3:>9.2f}" for k in (*BREAKDOWN_COLUMNS, "step")))
    for w, usage in enumerate(result.threads):
        per = thread_medians(usage[warmup:])
        text = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f}" for k, v in per.items())
        echo(f"worker {w} threads, median ms per step: {text}")


BREAKDOWN_COLUMNS = ("slice", "fill", "post", "wait", "loss", "other")


def _show_schedule(spec, p) -> None:
    """Every worker's program, as its process will run it."""
    from netpart.compile.schedule import plan_schedule

    _, schedule = plan_schedule(spec, p)
    for w in range(p.workers):
        echo(f"worker {w}: {len(schedule.instructions(w))} instructions")
        echo(schedule.table(w))
        echo()


def cmd_check(args: argparse.Namespace) -> int:
    import json

    from netpart.models.importer import is_module_target, load_module
    from netpart.partition import plan
    from netpart.runtime.check import (
        check_step,
        check_step_distributed,
        require_memory,
        under_torchrun,
    )

    spec, p = plan_for_run(args)
    require_memory(spec, args.batch)
    # a user's module is the reference itself (its spec was read from it)
    module = load_module(args.model) if is_module_target(args.model) else None
    p = p or plan(spec, args.workers, args.method, seed=args.seed, memory=available_memory())
    if args.show_schedule and os.environ.get("RANK", "0") == "0":
        _show_schedule(spec, p)
    how = {"tolerance": args.tolerance, "timeout": args.timeout, "module": module}
    if under_torchrun():
        report = check_step_distributed(spec, p, args.batch, args.seed, **how)
        if report is None:  # not rank 0: rank 0 prints the verdict
            return 0
        result = None
    else:
        report, result = check_step(spec, p, args.batch, args.seed, **how)
    against = f"your {type(module).__name__}" if module is not None else "reference"
    echo(f"{spec.name}: {args.workers} worker processes ({p.method}) vs {against}, float64")
    echo(f"{'quantity':<28} {'max abs diff':>14} {'max rel diff':>14}  ok")
    for d in report.differences:
        echo(f"{d.name:<28} {d.max_abs:>14.3e} {d.max_rel:>14.3e}  {'yes' if d.ok else 'NO'}")
    echo(f"\n{'layer':>5} {'phase':<9} {'bytes sent':>12} {'planned':>12}")
    for layer, phase, measured, planned in report.bytes_rows:
        echo(f"{layer:>5} {phase:<9} {measured:>12,} {planned:>12,}")
    if args.stats is not None and result is not None:
        stats = {
            "model": spec.name,
            "workers": args.workers,
            "batch": args.batch,
            "bytes_match_plan": report.bytes_match,
            "per_worker": per_worker_stats(result),
            "differences": [vars(d) for d in report.differences],
        }
        write_atomic(args.stats, json.dumps(stats, indent=1).encode())
    verdict = "OK" if report.ok else "MISMATCH"
    echo(
        f"\n{verdict}: {'all within' if report.ok else 'not all within'} {args.tolerance:g}; "
        f"bytes {'equal' if report.bytes_match else 'differ from'} the plan"
    )
    return 0 if report.ok else 1
