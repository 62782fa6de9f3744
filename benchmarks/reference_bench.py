"""The step DistributedDataParallel runs against netpart's (issue 47): a model's reference
module (`netpart.models.build_reference`, what `cluster_bench.py` trains with DDP), its
forward and backward, and with fused Adagrad's update, against netpart's one-worker step
(`netpart.runtime.check.lone_step`, the step `netpart plan --machines` prices an all-reduce
layout's replica with), on one thread of this host, batch 32, float32. CPU seconds a step,
the cases alternated in `--rounds` rounds of `--steps` steps after untimed ones
(`netpart.ps.timed_exchange.timed_calls`), medians.

    python benchmarks/reference_bench.py --out benchmarks/results/reference_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.files import write_atomic
from netpart.models import build_reference, load_spec
from netpart.partition.planner import plan
from netpart.ps.timed_exchange import timed_calls
from netpart.runtime.check import lone_step, make_batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-local")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as netpart's training processes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = load_spec(args.model)
    netpart_step = lone_step(spec, plan(spec, 1, seed=0, batch=32), dist.group.WORLD, 0)
    model = build_reference(spec).float()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01, fused=True)  # as cluster_bench's DDP
    x, y = make_batch(spec, 32, 0)
    x = x.float()

    def backward() -> None:
        opt.zero_grad()
        model.loss(model(x), y).backward()

    def with_update() -> None:
        backward()
        opt.step()

    cases = {"netpart": netpart_step, "reference": backward, "reference+update": with_update}
    seen: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            seen[name].append(timed_calls(fn, args.steps)[1])  # CPU seconds a call
    dist.destroy_process_group()
    medians = {k: statistics.median(v) for k, v in seen.items()}
    for name, cpu in medians.items():
        print(
            f"{name:<17} {cpu * 1e3:8.2f} ms CPU a step, {cpu / medians['netpart']:.2f}x netpart's"
        )
    if args.out is not None:
        result = {
            "model": args.model,
            "steps": args.steps,
            "rounds": args.rounds,
            "cpu_s": medians,
            "rounds_cpu_s": seen,
        }
        write_atomic(args.out, json.dumps(result, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
