"""The ring all-reduce DistributedDataParallel runs a step, on emulated machines (issue 47):
what `netpart calibrate` times of it, against DDP's own step on the same machines, and what
else on the host moves it.

On a testbed of `--machines` machines (`netpart testbed`: `--cpu` of a core, `--link`), in
`--rounds` rounds, the cases rotated, medians. Every machine all-reduces each of `--sizes`,
back to back (`netpart.ps.timed_exchange.ps_loop`, mode `allreduce`, as the calibration runs it):

- **ring alone**: over the process's only group, as DDP's processes run it, gloo's I/O
  threads as gloo starts them, nothing else of the bench's awake: as `netpart calibrate`
  times it since 678483c (`netpart.calibrate.ring`);
- **ring alone, idle groups on each machine**: the same, while a process on each machine
  holds 8 idle gloo groups (each with an I/O thread that wakes 100 times a second), as the
  calibration's processes did while it timed the ring (2871936 to 678483c);
- **ring alone, a host process waking**: the same, while a process on the host, outside every
  machine's cgroup and namespace, sleeps 0.5 ms at a time;
- **ring among 8 groups**: over a new group, 7 more made beside it in the same process and
  left idle, as the calibration's own processes ran it (e9e9abd to 2871936);
- **ring among 8 groups, SCHED_BATCH**: the same with gloo's I/O threads made SCHED_BATCH,
  as netpart's processes make theirs (`netpart.processes.launcher.yield_io_threads`): the
  table before e9e9abd;
- **DDP**: digits-mlp trained by DistributedDataParallel on every machine, `--steps` steps
  (`cluster_bench.py`'s job: its backward holds the all-reduce of digits-mlp's 340 KB of
  gradients): its step, backward and CPU a step.

Each ring's figure is the slowest machine's mean time and CPU an all-reduce. Needs root.

    python benchmarks/ring_bench.py --machines 6 --out benchmarks/results/ring_bench_m6.json
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

from netpart.files import write_atomic
from netpart.planning.cluster import Layout
from netpart.testbed.bed import down, read, up

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_bench import parts, train  # sibling scripts
from ps_exchange_bench import role_out

SIZES = (16_000, 125_000, 340_008, 500_000, 4_000_000)  # 340,008: digits-mlp's gradients

ROLE = r"""
import json, os, sys
import torch, torch.distributed as dist
from netpart.processes.launcher import yield_io_threads
from netpart.ps.timed_exchange import ps_loop
rank, world, repeats, idle = map(int, sys.argv[1:5])
store, policy, sizes = sys.argv[5], sys.argv[6], json.loads(sys.argv[7])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
group = dist.group.WORLD if idle < 0 else dist.new_group(list(range(world)))
others = [dist.new_group(list(range(world))) for _ in range(max(idle, 0))]
yield_io_threads(os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER)
seconds, cpu = ps_loop(group, rank, "allreduce", sizes, repeats)
slowest = torch.tensor([*seconds, *cpu], dtype=torch.float64)
dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
if rank == 0:
    print(json.dumps(slowest.tolist()))
dist.destroy_process_group()
del group, others  # held at exit, a group's threads outlive the interpreter: an abort
"""

# a process on every machine holding idle groups (each group's I/O thread wakes 100 times a
# second) until the bench ends it
IDLE_GROUPS = r"""
import sys, time
import torch.distributed as dist
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
groups = [dist.new_group(list(range(world))) for _ in range(7)]
print("ready", flush=True)
time.sleep(3600)
"""
WAKER = "import time\nwhile True: time.sleep(0.0005)"  # on the host, in no machine

# each ring case: idle groups beside the ring's in its process (-1: the ring over the default
# group), gloo's I/O threads' policy, and what runs beside it
RINGS = {
    "ring alone": (-1, "other", None),
    "ring alone, idle groups on each machine": (-1, "other", "groups"),
    "ring alone, a host process waking": (-1, "other", "waker"),
    "ring among 8 groups": (7, "other", None),
    "ring among 8 groups, SCHED_BATCH": (7, "batch", None),
}
CASES = (*RINGS, "DDP")


def beside(bed: str, what: str | None, machines: int, tmp: Path) -> list[subprocess.Popen]:
    """Start what runs beside a ring case (`RINGS`); the caller ends it."""
    if what is None:
        return []
    if what == "waker":
        return [subprocess.Popen([sys.executable, "-c", WAKER])]
    testbed, store = read(bed), tmp / f"g{time.monotonic_ns()}"
    procs = [
        subprocess.Popen(
            testbed.command(
                r,
                [sys.executable, "-c", IDLE_GROUPS, str(r), str(machines), str(store)],
                {"GLOO_SOCKET_IFNAME": testbed.hosts[r].device},
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(machines)
    ]
    for p in procs:  # every group made before the ring starts
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("idle groups: a machine's process failed to start")
    return procs


def run(bed: str, case: str, args, tmp: Path) -> dict:
    """One measurement of `case` on testbed `bed`."""
    at = tmp / f"r{time.monotonic_ns()}"
    if case == "DDP":
        job = argparse.Namespace(model="digits-mlp", steps=args.steps, data="digits")
        train(bed, Layout("allreduce", args.machines, 1, 0), job, at)
        got = parts(at, args.machines)
        shutil.rmtree(at, ignore_errors=True)
        return {k: got[k] for k in ("step_s", "backward_s", "cpu_s")}
    idle, policy, aside = RINGS[case]
    argv = [
        str(args.machines),
        str(args.repeats),
        str(idle),
        str(at),
        policy,
        json.dumps(list(SIZES)),
    ]
    others = beside(bed, aside, args.machines, tmp)
    try:
        out = json.loads(role_out(bed, ROLE, args.machines, argv, case))
    finally:
        for p in others:
            p.kill()
            p.wait()
    return {"seconds": out[: len(SIZES)], "cpu": out[len(SIZES) :]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=6)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--repeats", type=int, default=30, help="all-reduces of each size")
    ap.add_argument("--steps", type=int, default=300, help="DDP's steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    name = f"rb{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="ring-bench-"))
    up(name, args.machines, cpu=args.cpu, rate=args.link)
    seen: dict[str, list[dict]] = {c: [] for c in CASES}
    try:
        for k in range(args.rounds):
            for case in CASES[k % len(CASES) :] + CASES[: k % len(CASES)]:
                seen[case].append(run(name, case, args, tmp))
            print(f"round {k + 1} done", flush=True)
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "machines": args.machines,
        "cpu": args.cpu,
        "link": args.link,
        "repeats": args.repeats,
        "steps": args.steps,
        "rounds": args.rounds,
        "sizes": list(SIZES),
        "cases": {},
    }
    for case, got in seen.items():
        keys = got[0].keys()
        medians = {
            k: (
                [statistics.median(g[k][i] for g in got) for i in range(len(SIZES))]
                if isinstance(got[0][k], list)
                else statistics.median(g[k] for g in got)
            )
            for k in keys
        }
        result["cases"][case] = {"median": medians, "rounds": got}
        if case == "DDP":
            print(
                f"{case}: step {medians['step_s'] * 1e3:.2f} ms, backward with its "
                f"all-reduce {medians['backward_s'] * 1e3:.2f} ms, CPU "
                f"{medians['cpu_s'] * 1e3:.2f} ms"
            )
            continue
        pairs = zip(SIZES, medians["seconds"], medians["cpu"], strict=True)
        each = ", ".join(
            f"{b / 1e3:g} kB {t * 1e3:.2f} ms (CPU {c * 1e3:.2f})" for b, t, c in pairs
        )
        print(f"{case}: {each}")
    if args.out is not None:
        write_atomic(args.out, json.dumps(result, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
