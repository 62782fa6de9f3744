"""DistributedDataParallel's step on emulated machines, taken apart (issue 47): what the
planner prices an all-reduce layout's replica with, against what DDP's replicas run.

On a testbed of `--machines` machines (`netpart testbed`: `--cpu` of a core, `--link`), in
`--rounds` rounds, the cases rotated, `--steps` steps each (the first fifth untimed), each
case's median step over its steps, medians over rounds; `--model`'s batch of 32, one thread,
float32, subnormals flushed (as netpart's processes and `cluster_bench.py`'s DDP job):

- **netpart alone, every machine**: netpart's one-worker step (`netpart.runtime.check.lone_step`,
  the step the planner's N = 1 prices) on every machine at once, no ring;
- **reference alone, every machine**: the model's reference module (`build_reference`), its
  forward, backward and fused Adagrad's update, on every machine at once, no ring: a DDP
  replica's step without its all-reduce;
- **reference alone, one machine**: the same on machine 0 only, as `netpart calibrate` times
  it (`netpart.calibrate.ddp_step`, the profile's `ps.replica`);
- **step, then all-reduce**: the reference step with the all-reduce of its gradients (one
  flat tensor) between backward and update, every machine: the step and the ring apart;
- **DDP**: `DistributedDataParallel`, its all-reduce in backward's hooks (`cluster_bench.py`'s
  job).

Per case, the step and its parts (forward, backward, the all-reduce where apart, update) and
the process's CPU a step, machine 0's. Needs root.

    python benchmarks/ddp_step_bench.py --machines 4 --out benchmarks/results/ddp_step_bench_m4.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from netpart.files import write_atomic
from netpart.testbed.bed import down, up

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ps_exchange_bench import role_out  # a sibling script

ROLE = r"""
import json, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from netpart.models import build_reference, load_spec
from netpart.partition.planner import plan
from netpart.runtime.check import lone_step, make_batch
rank, world, steps = map(int, sys.argv[1:4])
store, name, case = sys.argv[4:7]
torch.set_num_threads(1)
torch.set_flush_denormal(True)
spec = load_spec(name)
ring = case in ("ddp", "apart")
if ring:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
else:  # netpart's step talks through a group of its own, one process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
rows = []
if case == "netpart":
    step = lone_step(spec, plan(spec, 1, seed=0, batch=32), dist.group.WORLD, 0)
    for _ in range(steps):
        a, ca = time.perf_counter(), time.process_time()
        step()
        b, cb = time.perf_counter(), time.process_time()
        rows.append([b - a, 0.0, 0.0, 0.0, 0.0, cb - ca])
else:
    model = build_reference(spec)
    net = DistributedDataParallel(model) if case == "ddp" else model
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01, fused=True)
    params = list(model.parameters())
    x, y = make_batch(spec, 32, rank)
    x = x.float()
    for _ in range(steps):
        a, ca = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = model.loss(net(x), y)
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        if case == "apart":
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            at = 0
            for p in params:
                p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
                at += p.numel()
        d = time.perf_counter()
        opt.step()
        e, ce = time.perf_counter(), time.process_time()
        rows.append([e - a, b - a, c - b, d - c, e - d, ce - ca])
if ring:
    dist.barrier()  # every rank's group closed together
dist.destroy_process_group()
print(json.dumps(rows))
"""
PARTS = ("step_s", "forward_s", "backward_s", "allreduce_s", "update_s", "cpu_s")
CASES = {  # case: (the role's case, machines it runs on: None for all)
    "netpart alone, every machine": ("netpart", None),
    "reference alone, every machine": ("reference", None),
    "reference alone, one machine": ("reference", 1),
    "step, then all-reduce": ("apart", None),
    "DDP": ("ddp", None),
}


def run(bed: str, case: str, machines: int, args, tmp: Path) -> dict[str, float]:
    """Machine 0's median of each of PARTS over the steps after the first fifth."""
    role, on = CASES[case]
    world = on or machines
    store = tmp / f"store{len(list(tmp.iterdir()))}"
    argv = [str(world), str(args.steps), str(store), args.model, role]
    rows = json.loads(role_out(bed, ROLE, world, argv, case))
    rows = rows[len(rows) // 5 :]
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(PARTS)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=4)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--model", default="bench-local")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    name = f"ddp{args.machines}"
    up(name, args.machines, cpu=args.cpu, rate=args.link)
    tmp = Path(tempfile.mkdtemp(prefix="ddp_step_bench_"))
    seen: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    cases = list(CASES)
    try:
        for k in range(args.rounds):
            for case in cases[k % len(cases) :] + cases[: k % len(cases)]:
                got = run(name, case, args.machines, args, tmp)
                seen[case].append(got)
                print(
                    f"round {k + 1}, {case}: step {got['step_s'] * 1e3:.1f} ms, CPU "
                    f"{got['cpu_s'] * 1e3:.1f} ms",
                    flush=True,
                )
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "machines": args.machines,
        "cpu": args.cpu,
        "link": args.link,
        "model": args.model,
        "steps": args.steps,
        "rounds": args.rounds,
        "cases": {},
    }
    for case, got in seen.items():
        medians = {k: statistics.median(g[k] for g in got) for k in PARTS}
        result["cases"][case] = {"median": medians, "rounds": got}
        each = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in medians.items() if v)
        print(f"{case}: {each} (ms)")
    if args.out is not None:
        write_atomic(args.out, json.dumps(result, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
