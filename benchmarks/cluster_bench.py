"""The cluster planner against measurements on an emulated cluster: `netpart plan --machines M`
predicts every layout of R replicas x N workers + S shards; each is trained on a testbed of M
machines (`netpart testbed`: a network namespace on a shaped switch and a cpu cgroup each) and
its samples/s measured, the layouts interleaved in rounds (round k runs them in an order
rotated by k), medians over rounds.

The prediction's machine: `experiments/machines/this-host.toml` (this host as calibrated) held
to the testbed's share of a core (every rate x share, every time figure / share) on the
testbed's link; or, with `--profile`, a profile `netpart calibrate --testbed` measured on such
machines. All-reduce layouts are predicted but not measured (netpart trains with a
parameter server). Measured samples/s: each replica's steps after the first fifth over the
time they took (its metrics), summed over replicas. Needs root.

    python benchmarks/cluster_bench.py --machines 4 --out benchmarks/results/cluster_bench_m4.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition.cluster import advise
from netpart.partition.cost import NetworkModel
from netpart.partition.machine import Machine, read_machine
from netpart.testbed import netns
from netpart.testbed.bed import down, up

ROOT = Path(__file__).resolve().parent.parent
HOST = ROOT / "experiments" / "machines" / "this-host.toml"
BATCH = 32


def on_share(machine: Machine, share: float, link_bps: float) -> Machine:
    """`machine` held to `share` of its core, on a link of `link_bps`."""
    kinds = {
        k: replace(
            r,
            flops_per_s=r.flops_per_s * share,
            overhead_s=r.overhead_s / share,
            per_value_s=r.per_value_s / share,
        )
        for k, r in machine.kinds.items()
    }
    return replace(
        machine, name=f"{machine.name} at {share:g} core", kinds=kinds,
        flops_per_s=machine.flops_per_s * share, overhead_s=machine.overhead_s / share,
        per_value_s=machine.per_value_s / share, latency_s=machine.latency_s / share,
        step_overhead_s=machine.step_overhead_s / share, bandwidth_bps=link_bps,
    )  # fmt: skip


def measured_samples_per_s(run: Path, replicas: int) -> float:
    total = 0.0
    for r in range(replicas):
        rows = [json.loads(x) for x in (run / f"metrics_replica{r}.jsonl").read_text().splitlines()]
        rows = rows[len(rows) // 5 :]
        span = rows[-1]["time"] - rows[0]["time"]
        total += sum(x["samples"] for x in rows[1:]) / span
    return total


def train(bed: str, layout, args, run: Path) -> float:
    argv = [sys.executable, "-m", "netpart", "train", "--testbed", bed, "--model", args.model,
            "--mode", layout.mode, "--replicas", str(layout.replicas), "--workers",
            str(layout.workers), "--ps-shards", str(layout.shards), "--steps", str(args.steps),
            "--data", args.data, "--batch", str(BATCH), "--timeout", "60",
            "--out", str(run)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: exit {done.returncode}: {done.stderr.strip()[-600:]}")
    return measured_samples_per_s(run, layout.replicas)


def _verdict(rows: list[dict], advice) -> None:
    """How many layouts measured within 15% of their prediction, and how the recommended
    one (the fastest predicted among those measured) fared against the best measured."""
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    best = max(rows, key=lambda r: r["measured"])
    top = max(rows, key=lambda r: r["predicted"])
    print(f"{within} of {len(rows)} within 15%; recommended (no all-reduce) {top['layout']} "
          f"measures {top['measured'] / best['measured']:.2f} of the best, {best['layout']}; "
          f"overall recommendation {advice.best.layout}")  # fmt: skip


def repredict(path: Path, out: Path, profile: Path | None = None) -> int:
    """Rewrite a result's predictions (and ratios) with this tree's model and its profile (or
    `profile`, which the result then names); the predictions it was run with stay as
    `predicted_at_run`."""
    result = json.loads(path.read_text())
    if profile is not None:
        result.setdefault("profile_at_run", result["profile"])
        result["profile"] = str(profile)
    profile = result["profile"]
    if profile:
        network = NetworkModel.from_profile(Path(profile).read_text(), profile)
    else:
        network = Machine.from_dict(result["machine"]).to_network()
    advice = advise(load_spec(result["model"]), result["machines"], network, batch=BATCH)
    now = {str(f.layout): f.samples_per_s for f in advice.layouts}
    for row in result["rows"]:
        row.setdefault("predicted_at_run", row["predicted"])
        row["predicted"] = now[row["layout"]]
        row["ratio"] = row["measured"] / row["predicted"]
        print(f"{row['layout']:<16} measured {row['measured']:9,.0f} samples/s, predicted "
              f"{row['predicted']:9,.0f} (at the run {row['predicted_at_run']:9,.0f})")  # fmt: skip
    result["recommended"] = str(advice.best.layout)
    _verdict(result["rows"], advice)
    write_atomic(out, json.dumps(result, indent=1).encode())
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=4)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--model", default="digits-mlp")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repredict", type=Path, default=None,
                    help="a result of this script: predict its layouts again with this tree's "
                    "model (same machines and model; its profile, or --profile), keep its "
                    "measurements")  # fmt: skip
    args = ap.parse_args(argv)
    if args.repredict is not None:
        return repredict(args.repredict, args.out or args.repredict, args.profile)
    link = netns.rate_bps(args.link)
    machine = on_share(read_machine(HOST), args.cpu, link)
    network = machine.to_network()
    if args.profile is not None:
        network = NetworkModel.from_profile(args.profile.read_text(), str(args.profile))
    advice = advise(load_spec(args.model), args.machines, network, batch=BATCH)
    layouts = [f for f in advice.layouts if f.layout.mode != "allreduce"]
    name = f"cb{os.getpid() % 100000}"
    up(name, args.machines, cpu=args.cpu, rate=args.link)
    seen: dict[str, list[float]] = {str(f.layout): [] for f in layouts}
    tmp = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    try:
        for k in range(args.rounds):
            order = layouts[k % len(layouts) :] + layouts[: k % len(layouts)]
            for f in order:
                run = tmp / f"r{k}-{str(f.layout).replace(' ', '_')}"
                seen[str(f.layout)].append(train(name, f.layout, args, run))
                shutil.rmtree(run, ignore_errors=True)
                got = seen[str(f.layout)][-1]
                print(f"round {k + 1}: {f.layout!s:<16} measured {got:9,.0f} samples/s, "
                      f"predicted {f.samples_per_s:9,.0f}", flush=True)  # fmt: skip
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for f in layouts:
        got = statistics.median(seen[str(f.layout)])
        rows.append({"layout": str(f.layout), "predicted": f.samples_per_s, "measured": got,
                     "rounds": seen[str(f.layout)], "ratio": got / f.samples_per_s})  # fmt: skip
    _verdict(rows, advice)
    if args.out is not None:
        result = {"machines": args.machines, "cpu": args.cpu, "link": args.link,
                  "model": args.model, "steps": args.steps, "machine": machine.to_dict(),
                  "profile": str(args.profile) if args.profile else None,
                  "recommended": str(advice.best.layout), "rows": rows}  # fmt: skip
        write_atomic(args.out, json.dumps(result, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
