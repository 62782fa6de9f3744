"""Data parallelism on emulated machines (issue 47): netpart's best parameter-server layout of
M machines against DistributedDataParallel with M replicas on the same M machines, samples/s
and held-out accuracy after the same number of training samples.

The testbed: M machines (`netpart testbed`: a network namespace on a shaped switch and a cpu
cgroup each), `--cpu` of a core and `--link` each. The job is dp_bench's (the digits MLP,
batch 32 per replica, SGD lr 0.05; netpart with n_push = n_fetch = 1). netpart trains the
layout `train --machines M` would (the fastest parameter-server layout predicted for such
machines: this host's description held to the share, as cluster_bench) in Downpour and in
sync, through `netpart train --testbed`; DDP runs one process per machine (dp_bench's
script, file rendezvous on the shared disk, gloo over the machine's link). Every system
trains SAMPLES samples in all (steps per replica = SAMPLES / (replicas x batch)); samples/s is
each system's own timing of its step loop (netpart: its replicas' metrics after the first
fifth of the steps, as cluster_bench), the systems alternated in rounds, medians. Needs root.

    python benchmarks/testbed_dp_bench.py --out benchmarks/results/testbed_dp_bench.json
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_bench import HOST, measured_samples_per_s, on_share
from dp_bench import BATCH, DDP, LR, prepare_data

from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition.cluster import advise, trainable
from netpart.partition.machine import read_machine
from netpart.testbed import netns
from netpart.testbed.bed import down, read, up

SAMPLES = 28_800  # in all: 300 steps of 3 replicas, 450 of 2


def run_netpart(bed: str, layout, mode: str, steps: int, tmp: Path, seed: int) -> dict:
    run = tmp / f"np-{mode}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "netpart", "train", "--testbed", bed, "--model", "digits-mlp",
            "--mode", mode, "--replicas", str(layout.replicas), "--workers",
            str(layout.workers), "--ps-shards", str(layout.shards), "--optimizer", "sgd",
            "--lr", str(LR), "--n-push", "1", "--n-fetch", "1", "--steps", str(steps),
            "--data", "digits", "--batch", str(BATCH), "--seed", str(seed), "--timeout", "60",
            "--out", str(run)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"netpart {mode}: exit {done.returncode}: {done.stderr[-600:]}")
    held = json.loads((run / "summary.json").read_text())["held_out"]
    out = {"samples_s": measured_samples_per_s(run, layout.replicas),
           "accuracy": held["accuracy"]}  # fmt: skip
    shutil.rmtree(run, ignore_errors=True)
    return out


def run_ddp(bed: str, machines: int, steps: int, data: Path, tmp: Path, seed: int) -> dict:
    testbed = read(bed)
    out, store = tmp / f"ddp{time.monotonic_ns()}", tmp / f"store{time.monotonic_ns()}"
    args = [str(data), str(steps), str(BATCH), str(LR), str(seed)]
    procs = []
    for i, host in enumerate(testbed.hosts):
        cmd = [sys.executable, "-c", DDP, *args, str(i), str(machines), str(out), str(store), ""]
        env = {"GLOO_SOCKET_IFNAME": host.device}
        procs.append(subprocess.Popen(testbed.command(i, cmd, env), stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"ddp: exit {p.returncode}: {err.decode()[-600:]}")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(machines)]
    span = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    return {"samples_s": sum(r["samples"] for r in ranks) / span,
            "accuracy": ranks[0]["accuracy"]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=3)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    m = args.machines
    network = on_share(read_machine(HOST), args.cpu, netns.rate_bps(args.link)).to_network()
    advice = advise(load_spec("digits-mlp"), m, network, batch=BATCH)
    layout = trainable(advice).layout
    steps_np = SAMPLES // (layout.replicas * BATCH)
    systems = [f"netpart {layout.mode} {layout.replicas}x{layout.workers}+{layout.shards}",
               f"netpart {'sync' if layout.mode == 'downpour' else 'downpour'} "
               f"{layout.replicas}x{layout.workers}+{layout.shards}", f"ddp x{m}"]  # fmt: skip
    name = f"tdp{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="testbed-dp-"))
    data = tmp / "digits.npz"
    prepare_data(data)
    up(name, m, cpu=args.cpu, rate=args.link)
    seen: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        for k in range(args.rounds):
            for system in systems[k % 3 :] + systems[: k % 3]:
                if system.startswith("ddp"):
                    got = run_ddp(name, m, SAMPLES // (m * BATCH), data, tmp, k)
                else:
                    got = run_netpart(name, layout, system.split()[1], steps_np, tmp, k)
                seen[system].append(got)
                print(f"round {k + 1}: {system:<24} {got['samples_s']:9,.0f} samples/s, "
                      f"held-out {got['accuracy']:.3f}", flush=True)  # fmt: skip
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {s: {"samples_s_median": statistics.median(r["samples_s"] for r in v),
                   "accuracy_median": statistics.median(r["accuracy"] for r in v), "runs": v}
               for s, v in seen.items()}  # fmt: skip
    ddp = summary[systems[2]]["samples_s_median"]
    for s, v in summary.items():
        print(f"{s:<24} {v['samples_s_median']:9,.0f} samples/s ({v['samples_s_median'] / ddp:.2f}"
              f"x DDP), held-out {v['accuracy_median']:.3f}")  # fmt: skip
    if args.out is not None:
        result = {"machines": m, "cpu": args.cpu, "link": args.link, "samples": SAMPLES,
                  "batch": BATCH, "lr": LR, "layout": str(layout), "results": summary}  # fmt: skip
        write_atomic(args.out, json.dumps(result, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
