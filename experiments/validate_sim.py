"""The step-time model against real steps on emulated dedicated machines.

Each emulated machine is a network namespace on a switch whose ports are limited with
`tc tbf` (its own link) and a cpu cgroup held to a share of one core (its own CPU: a worker and
its gloo threads compete with nothing else). `netpart calibrate` runs on those machines (slices
timed on one, the link and the loss's collective among 2 up to all of them, steps on one and
two, exchange-only steps), then each model
runs in N real worker processes, one per machine, against `netpart plan --profile`'s prediction
for the same plan. Three runs, each row the median of its launches in the run (three, in
passes over all rows: minutes apart); error = predicted / measured - 1. Each row also gives
the CPU floor: the CPU a step takes on its busiest worker (all threads) / the share, below which no
step on those machines can run (a step near it is CPU-bound: the quota, not the critical path
the model sums, sets its time), and how much slower than at calibration the machine's cores
ran (`slowdown`: the speed probe, `netpart.calibrate.speed`, against the profile's). Needs
root (namespaces, cgroups); without it, says why and writes nothing.

    python experiments/validate_sim.py                # ~50 min here (three launches a row)
    python experiments/validate_sim.py --workers 8 --share 0.2

Writes experiments/results/validation.json (and .csv) and the profile, emulated_profile.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # experiments/ helpers

from experiments._common import write_csv  # noqa: E402
from netpart.calibrate.emulated import TIMEOUT, EmulatedRunner, free_port  # noqa: E402
from netpart.calibrate.measure import CALIBRATION_MODELS, calibrate  # noqa: E402
from netpart.calibrate.profile import profile_json  # noqa: E402
from netpart.calibrate.speed import SpeedProbe  # noqa: E402
from netpart.cost.machine import Machine  # noqa: E402
from netpart.files import write_atomic  # noqa: E402
from netpart.models import load_spec  # noqa: E402
from netpart.partition import plan  # noqa: E402
from netpart.partition.evaluate import reevaluate  # noqa: E402
from netpart.processes.launcher import reaped, wait_all  # noqa: E402
from netpart.runtime.step import timed_steps  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
BATCH, STEPS = 32, 12
MODELS = ("digits-mlp", "bench-local", "bench-local-wide")
REPEATS = 3  # runs of each calibration step measurement


def _say(text: str) -> None:
    print(text, flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,3,4", help="machine counts to validate")
    ap.add_argument("--share", type=float, default=0.45, help="each machine's share of a core")
    ap.add_argument("--rate", default="100mbit", help="each machine's link (tc tbf)")
    ap.add_argument(
        "--burst",
        default=None,
        help="token bucket, bytes (default: half a millisecond of the rate, which the link "
        "then carries; one frame, 1600, carried 20-31%% of 1 Gbit/s)",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--launches",
        type=int,
        default=3,
        help="launches of each row per run, one pass over all rows after another, so that "
        "they fall at different times; the row is their median",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument(
        "--calibrate", default=",".join(CALIBRATION_MODELS), help="models to calibrate on"
    )
    ap.add_argument(
        "--via",
        choices=("runner", "torchrun"),
        default="runner",
        help="calibrate through this script's runner, or as a user would across machines: "
        "`torchrun ... -m netpart calibrate` with one process on every emulated machine",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    from netpart.testbed import cgroups, netns
    from netpart.testbed.bed import unavailable

    # A stop (SIGTERM) unwinds like Ctrl-C, so namespaces and cgroups are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why is not None:
        print(f"validate_sim: skipped: {why}")
        return 0
    if args.launches < 1 or args.runs < 1:
        ap.error(f"--runs and --launches are at least 1, got {args.runs} and {args.launches}")
    counts = [int(v) for v in args.workers.split(",")]
    models = args.models.split(",")
    machines = max(2, *counts)
    rows = []
    with (
        netns.switched_hosts(machines, rate=args.rate, burst=args.burst) as hosts,
        cgroups.cpu_shares(machines, args.share) as groups,
    ):
        runner = EmulatedRunner(hosts, groups, args.share, env={"PYTHONPATH": str(ROOT)})
        t0 = time.monotonic()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "emulated_profile.json"
        model, profile = _profile(args, hosts, groups, runner, path)
        _say(f"calibrated in {time.monotonic() - t0:.0f} s: {model.describe()}")
        for run in range(1, args.runs + 1):
            rows += _run(runner, model, models, counts, run, args.launches, args.via)
    doc = {
        "share": args.share,
        "rate": args.rate,
        "batch": BATCH,
        "steps": STEPS,
        "launches": args.launches,
        "machines": machines,
        "calibrated_via": args.via,
        "profile": json.loads(profile)["model"],
        "rows": rows,
    }
    write_atomic(args.out / "validation.json", json.dumps(doc, indent=1).encode())
    write_csv(args.out / "validation.csv", [_flat(r) for r in rows])
    _summary(rows)
    return 0


def _profile(args, hosts, groups, runner, path: Path) -> tuple[Machine, str]:
    """The emulated machines calibrated (through the runner or torchrun) into `path`: the
    model and the profile's text."""
    if args.via == "torchrun":
        _calibrate_torchrun(hosts, groups, args.calibrate, args.share, path)
        profile = path.read_text()
        return Machine.from_profile(profile, str(path)), profile
    cal = tuple(args.calibrate.split(","))
    model, details = calibrate(cal, say=_say, runner=runner, repeats=REPEATS)
    profile = profile_json(model, details)
    write_atomic(path, profile.encode())
    return replace(model, profile=str(path)), profile


def _run(runner, model, models, counts, run: int, launches: int, via: str) -> list[dict]:
    """One run's rows: every (model, N) launched `launches` times, in passes over all of
    them; a row's step time, CPU floor and probe are the medians over its launches."""
    cases = {}
    for name in models:
        spec = load_spec(name)
        for n in counts:
            p = plan(spec, n, "metis", batch=BATCH)
            cases[(name, n)] = (spec, p, reevaluate(spec, p, BATCH, model).metrics)
    # A profile calibrated through torchrun probed inside machine 0; this probe runs
    # outside the machines: not comparable.
    beside = via == "runner" and model.probe_s > 0
    seen = {case: [] for case in cases}
    for k in range(launches):
        for (name, n), (spec, p, predicted) in cases.items():
            steps = timed_steps(predicted.predicted_step_s, STEPS)[0]  # as `run`
            with SpeedProbe() as probe:
                times, cpu = runner.run(spec, p, BATCH, steps)
            slow = probe.median() / model.probe_s if beside else None
            seen[(name, n)].append((float(np.median(times)), cpu, slow))
            _say(
                f"run {run} launch {k + 1}  {name:<17} N={n}  {np.median(times) * 1e3:7.1f} "
                f"ms  (predicted {predicted.predicted_step_s * 1e3:.1f})"
                + (f"; probe {slow:.2f}x" if slow else "")
            )
    rows = []
    for (name, n), (_, _, predicted) in cases.items():
        times, cpus, slows = zip(*seen[(name, n)], strict=True)
        row = _row(run, name, n, float(np.median(times)), predicted)
        row["launches_ms"] = [t * 1e3 for t in times]
        row["cpu_floor_ms"] = float(np.median(cpus)) / runner.share * 1e3
        row["slowdown"] = float(np.median(slows)) if beside else None
        row["slowdowns"] = list(slows) if beside else None
        rows.append(row)
        _say(_line(row))
    return rows


def _calibrate_torchrun(hosts, groups, models: str, share: float, out: Path) -> None:
    """`netpart calibrate --out OUT` under torchrun, one process on each machine (static
    rendezvous on machine 0), as across real machines (`netpart.calibrate.hosts`)."""
    from netpart.testbed import cgroups

    torchrun, port = str(Path(sys.executable).with_name("torchrun")), free_port()
    with reaped([]) as procs:
        for rank, host in enumerate(hosts):
            argv = [
                torchrun,
                "--nnodes",
                str(len(hosts)),
                *"--nproc-per-node 1 --node-rank".split(),
                str(rank),
                "--master-addr",
                hosts[0].address,
                "--master-port",
                str(port),
                "--local-addr",
                host.address,
                *"-m netpart calibrate --models".split(),
                models,
                "--repeats",
                str(REPEATS),
                "--share",
                str(share),
                "--out",
                str(out),
            ]
            env = {
                "PYTHONPATH": str(ROOT),
                "GLOO_SOCKET_IFNAME": host.device,
                "TORCH_CPP_LOG_LEVEL": "ERROR",
            }
            procs.append(subprocess.Popen(cgroups.command(groups[rank], host.command(argv, env))))
        wait_all(procs, 3 * TIMEOUT, "`netpart calibrate` under torchrun on a machine")


def _row(run: int, model: str, n: int, measured: float, m) -> dict:
    return {
        "run": run,
        "model": model,
        "workers": n,
        "measured_ms": measured * 1e3,
        "predicted_ms": m.predicted_step_s * 1e3,
        "error": m.predicted_step_s / measured - 1,
        "predicted_compute_ms": m.compute_s * 1e3,
        "predicted_exchange_ms": m.exchange_s * 1e3,
    }


def _line(r: dict) -> str:
    return (
        f"run {r['run']}  {r['model']:<17} N={r['workers']}  measured {r['measured_ms']:7.1f} ms"
        f"  predicted {r['predicted_ms']:7.1f} ms ({r['error']:+.0%}; compute "
        f"{r['predicted_compute_ms']:.1f}, exposed exchange {r['predicted_exchange_ms']:.1f}); "
        f"CPU floor {r['cpu_floor_ms']:.1f} ms"
        + (f"; speed probe at {r['slowdown']:.2f}x its calibrated time" if r["slowdown"] else "")
    )


def _flat(row: dict) -> dict:
    """`row` for CSV: a list of per-launch figures as one space-separated field."""
    return {
        k: " ".join(f"{x:.4g}" for x in v) if isinstance(v, list) else v for k, v in row.items()
    }


def _summary(rows: list[dict]) -> None:
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    _say(f"within 15%: {within} of {len(rows)} rows")
    if len(rows[0]["launches_ms"]) > 1:  # what one launch per row would have scored
        first = sum(abs(r["predicted_ms"] / r["launches_ms"][0] - 1) <= 0.15 for r in rows)
        _say(f"(the first launch of each row alone: {first} of {len(rows)})")
    for model in dict.fromkeys(r["model"] for r in rows):
        for n in sorted({r["workers"] for r in rows if r["model"] == model}):
            errs = [r["error"] for r in rows if r["model"] == model and r["workers"] == n]
            _say(f"  {model:<17} N={n}: " + ", ".join(f"{e:+.0%}" for e in errs))


if __name__ == "__main__":
    sys.exit(main())
