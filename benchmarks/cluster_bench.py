"""The cluster planner against measurements on an emulated cluster: `netpart plan --machines M`
predicts every layout of R replicas x N workers + S shards; each is trained on a testbed of M
machines (`netpart testbed`: a network namespace on a shaped switch and a cpu cgroup each) and
its samples/s measured, the layouts interleaved in rounds (round k runs them in an order
rotated by k), medians over rounds; this host's speed probe (`netpart.calibrate.speed`) is
sampled through each round and its median stated against the profile's.

The prediction's machine: `experiments/machines/this-host.toml` (this host as calibrated) held
to the testbed's share of a core (every rate x share, every time figure / share) on the
testbed's link; or, with `--profile`, a profile `netpart calibrate --testbed` measured on such
machines. All-reduce over M replicas, which netpart does not train, runs as
DistributedDataParallel: netpart's reference module of the model (`build_reference`), one
process per machine, the same batches, Adagrad at netpart's default rate (torch's fused
kernel, as netpart's shards run it), subnormals flushed as netpart's processes do. Measured
samples/s: each replica's steps after the first fifth over the time they took (netpart: its
metrics; DDP: rank 0's clock), summed over replicas. Where each run's steps went is kept
beside it (`parts`: netpart's metrics' compute, halo exchange, parameter-server exchange,
batch and worker's CPU; DDP's forward, backward with its all-reduce, update and CPU), and the
model-parallel step the planner predicted for its N, so a miss shows its cause. Needs root.

    python benchmarks/cluster_bench.py --machines 4 --out benchmarks/results/cluster_bench_m4.json

`--layouts` measures some of the planner's layouts only (its verdict is then over those).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from harness import parser, role_out, write_results

from netpart.calibrate.speed import SpeedProbe
from netpart.cost.machine import Machine
from netpart.cost.sheet import MachineSheet, read_sheet
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition.planner import plan
from netpart.planning.cluster import advise
from netpart.testbed import netns
from netpart.testbed.bed import down, up
from netpart.train.config import DEFAULT_LR

ROOT = Path(__file__).resolve().parent.parent
HOST = ROOT / "experiments" / "machines" / "this-host.toml"
BATCH = 32

DDP = r"""
import json, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from netpart.data import load_data
from netpart.models import build_reference, load_spec
rank, world, steps, batch = map(int, sys.argv[1:5])
store, name, data, lr = sys.argv[5], sys.argv[6], sys.argv[7], float(sys.argv[8])
torch.set_num_threads(1)
torch.set_flush_denormal(True)  # as netpart's training processes
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
spec = load_spec(name)
model = build_reference(spec)
net = DistributedDataParallel(model)
opt = torch.optim.Adagrad(net.parameters(), lr=lr, fused=True)  # as netpart's shards
source = load_data(data, spec)
stamps, parts = [], []  # parts: seconds of the batch, forward, backward (with the
# all-reduce, which DDP runs from backward's hooks), update; CPU seconds of the process
last, cpu = time.perf_counter(), time.process_time()
for t in range(1, steps + 1):
    x, y = source.batch(rank, world, t, batch, torch.float32)
    a = time.perf_counter()
    opt.zero_grad()
    loss = model.loss(net(x), y)
    b = time.perf_counter()
    loss.backward()
    c = time.perf_counter()
    opt.step()
    d, now = time.perf_counter(), time.process_time()
    stamps.append(time.time())
    parts.append([a - last, b - a, c - b, d - c, now - cpu])
    last, cpu = d, now
dist.barrier()  # every rank's group closed together (gloo aborts a process otherwise)
dist.destroy_process_group()
print(json.dumps({"stamps": stamps, "parts": parts}))
"""
DDP_PARTS = ("data_s", "forward_s", "backward_s", "update_s", "cpu_s")


def on_share(machine: MachineSheet, share: float, link_bps: float) -> MachineSheet:
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
        machine,
        name=f"{machine.name} at {share:g} core",
        kinds=kinds,
        flops_per_s=machine.flops_per_s * share,
        overhead_s=machine.overhead_s / share,
        per_value_s=machine.per_value_s / share,
        latency_s=machine.latency_s / share,
        step_overhead_s=machine.step_overhead_s / share,
        bandwidth_bps=link_bps,
    )


def measured_samples_per_s(run: Path, replicas: int) -> float:
    total = 0.0
    for r in range(replicas):
        rows = [json.loads(x) for x in (run / f"metrics_replica{r}.jsonl").read_text().splitlines()]
        rows = rows[len(rows) // 5 :]
        span = rows[-1]["time"] - rows[0]["time"]
        total += sum(x["samples"] for x in rows[1:]) / span
    return total


PARTS = ("step_s", "compute_s", "halo_s", "ps_s", "data_s", "cpu_s")


def parts(run: Path, replicas: int) -> dict[str, float]:
    """Where a run's steps went: netpart's, the mean of each of `PARTS` (its metrics lines:
    the step, its compute, halo exchange, parameter-server exchange, batch, and the worker's
    CPU) over each replica's steps after the first fifth, averaged over the replicas; DDP's,
    rank 0's (`DDP_PARTS`, written by `_ddp`)."""
    if (run / "parts.json").exists():
        return json.loads((run / "parts.json").read_text())
    means = []
    for r in range(replicas):
        rows = [json.loads(x) for x in (run / f"metrics_replica{r}.jsonl").read_text().splitlines()]
        rows = rows[len(rows) // 5 + 1 :]
        means.append([statistics.fmean(x[k] for x in rows) for k in PARTS])
    return {k: statistics.fmean(m[i] for m in means) for i, k in enumerate(PARTS)}


def train(bed: str, layout, args, run: Path) -> float:
    """Samples/s of `layout` trained on testbed `bed`: netpart's, or DDP's for all-reduce."""
    if layout.mode == "allreduce":
        return _ddp(bed, layout.replicas, args, run)
    argv = [
        sys.executable,
        *"-m netpart train --testbed".split(),
        bed,
        "--model",
        args.model,
        "--mode",
        layout.mode,
        "--replicas",
        str(layout.replicas),
        "--workers",
        str(layout.workers),
        "--ps-shards",
        str(layout.shards),
        "--steps",
        str(args.steps),
        "--data",
        args.data,
        "--batch",
        str(BATCH),
        *"--timeout 60 --out".split(),
        str(run),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: exit {done.returncode}: {done.stderr.strip()[-600:]}")
    return measured_samples_per_s(run, layout.replicas)


def _round(k: int, bed: str, layouts, args, tmp: Path, seen: dict, split: dict) -> float:
    """Round k: every layout once, in an order rotated by k (each measurement appended to
    `seen`, its `parts` to `split`); the median speed probe of this host while it
    ran (CPU seconds)."""
    with SpeedProbe(every=1.0) as probe:
        for f in layouts[k % len(layouts) :] + layouts[: k % len(layouts)]:
            run = tmp / f"r{k}-{str(f.layout).replace(' ', '_')}"
            seen[str(f.layout)].append(train(bed, f.layout, args, run))
            got = seen[str(f.layout)][-1]
            split[str(f.layout)].append(parts(run, f.layout.replicas))
            where = ", ".join(
                f"{part.removesuffix('_s')} {v * 1e3:.2f}"
                for part, v in split[str(f.layout)][-1].items()
            )
            shutil.rmtree(run, ignore_errors=True)
            print(
                f"round {k + 1}: {f.layout!s:<16} measured {got:9,.0f} samples/s, predicted "
                f"{f.samples_per_s:9,.0f} (ms a step: {where})",
                flush=True,
            )
    print(f"round {k + 1}: speed probe {probe.median() * 1e3:.2f} ms", flush=True)
    return probe.median()


def _ddp(bed: str, machines: int, args, run: Path) -> float:
    """All-reduce over `machines` replicas as DistributedDataParallel trains it."""
    run.mkdir(parents=True, exist_ok=True)
    argv = [
        str(machines),
        str(args.steps),
        str(BATCH),
        str(run / "store"),
        args.model,
        args.data,
        str(DEFAULT_LR["adagrad"]),
    ]
    out = json.loads(role_out(bed, DDP, machines, argv, f"all-reduce x{machines}"))
    first = len(out["stamps"]) // 5
    stamps, steps = out["stamps"][first:], out["parts"][first + 1 :]
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    means = {k: statistics.fmean(x[i] for x in steps) for i, k in enumerate(DDP_PARTS)}
    write_atomic(run / "parts.json", json.dumps({"step_s": step_s, **means}).encode())
    return machines * BATCH / step_s


def _verdict(rows: list[dict], advice) -> None:
    """How many layouts measured within 15% of their prediction, and how the recommended
    one (the fastest predicted among those measured, and of those netpart trains) fared
    against the best measured."""
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    best = max(rows, key=lambda r: r["measured"])
    for what, among in (
        ("recommended", rows),
        ("netpart's", [r for r in rows if not r["layout"].startswith("all")]),
    ):
        if not among:  # one machine: all-reduce alone
            continue
        top = max(among, key=lambda r: r["predicted"])
        print(
            f"{what}: {top['layout']} measures {top['measured'] / best['measured']:.2f} of "
            f"the best, {best['layout']}"
        )
    print(f"{within} of {len(rows)} within 15%; overall recommendation {advice.best.layout}")


def chosen(layouts, names: str | None) -> list:
    """The layouts named in `names` (comma-separated, as a layout prints; None: all)."""
    if names is None:
        return list(layouts)
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = {str(f.layout): f for f in layouts}
    unknown = [n for n in want if n not in known]
    if unknown:
        raise SystemExit(
            f"--layouts: {', '.join(unknown)} not among the planner's layouts ({', '.join(known)})"
        )
    return [known[n] for n in want]


def mp_steps(spec, layouts, network: Machine) -> dict[int, float]:
    """The model-parallel step the planner predicts at each N of `layouts` (all-reduce: 1)."""
    counts = {f.layout.workers for f in layouts}
    return {
        n: plan(spec, n, seed=0, batch=BATCH, network=network).metrics.predicted_step_s
        for n in counts
    }


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
        network = Machine.from_profile(Path(profile).read_text(), profile)
    else:
        network = MachineSheet.from_dict(result["machine"]).to_machine()
    spec = load_spec(result["model"])
    advice = advise(spec, result["machines"], network, batch=BATCH)
    now = {str(f.layout): f for f in advice.layouts}
    mp = mp_steps(spec, advice.layouts, network)
    for row in result["rows"]:
        f = now[row["layout"]]
        row.setdefault("predicted_at_run", row["predicted"])
        row.update(
            predicted=f.samples_per_s,
            predicted_step_s=f.step_s,
            predicted_mp_step_s=mp[f.layout.workers],
        )
        row["ratio"] = row["measured"] / row["predicted"]
        print(
            f"{row['layout']:<16} measured {row['measured']:9,.0f} samples/s, predicted "
            f"{row['predicted']:9,.0f} (at the run {row['predicted_at_run']:9,.0f})"
        )
    result["recommended"] = str(advice.best.layout)
    _verdict(result["rows"], advice)
    write_atomic(out, json.dumps(result, indent=1).encode())
    return 0


def _parser():
    ap = parser("cluster_bench", __doc__)
    ap.set_defaults(rounds=2)
    ap.add_argument("--machines", type=int, default=4)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--model", default="digits-mlp")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument(
        "--layouts",
        default=None,
        help="only these of the planner's layouts, comma-separated as it prints "
        "them (e.g. 'downpour 1x1+3,sync 3x1+1'): to measure a few again, in more "
        "rounds",
    )
    ap.add_argument(
        "--repredict",
        type=Path,
        default=None,
        help="a result of this script: predict its layouts again with this tree's "
        "model (same machines and model; its profile, or --profile), keep its "
        "measurements",
    )
    return ap


def _rows(layouts, seen: dict, split: dict, mp: dict) -> list[dict]:
    """Each layout's prediction beside its measured rounds (samples/s)."""
    rows = []
    for f in layouts:
        got = statistics.median(seen[str(f.layout)])
        rows.append(
            {
                "layout": str(f.layout),
                "predicted": f.samples_per_s,
                "measured": got,
                "rounds": seen[str(f.layout)],
                "ratio": got / f.samples_per_s,
                "parts": split[str(f.layout)],
                "predicted_step_s": f.step_s,
                "predicted_mp_step_s": mp[f.layout.workers],
            }
        )
    return rows


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.repredict is not None:
        return repredict(args.repredict, args.out or args.repredict, args.profile)
    link = netns.rate_bps(args.link)
    machine = on_share(read_sheet(HOST), args.cpu, link)
    network = machine.to_machine()
    if args.profile is not None:
        network = Machine.from_profile(args.profile.read_text(), str(args.profile))
    spec = load_spec(args.model)
    advice = advise(spec, args.machines, network, batch=BATCH)
    layouts = chosen(advice.layouts, args.layouts)
    name = f"cb{os.getpid() % 100000}"
    up(name, args.machines, cpu=args.cpu, rate=args.link)
    seen: dict[str, list[float]] = {str(f.layout): [] for f in layouts}
    split: dict[str, list[dict]] = {str(f.layout): [] for f in layouts}
    tmp = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    try:
        probes = [_round(k, name, layouts, args, tmp, seen, split) for k in range(args.rounds)]
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    if network.probe_s > 0:
        print(
            "speed probe per round / the profile's: "
            + ", ".join(f"{p / network.probe_s:.2f}" for p in probes)
        )
    rows = _rows(layouts, seen, split, mp_steps(spec, layouts, network))
    _verdict(rows, advice)
    result = {
        "machines": args.machines,
        "cpu": args.cpu,
        "link": args.link,
        "model": args.model,
        "steps": args.steps,
        "machine": machine.to_dict(),
        "profile": str(args.profile) if args.profile else None,
        "recommended": str(advice.best.layout),
        "probes": probes,
        "profile_probe": network.probe_s,
        "rows": rows,
    }
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
