"""A step against the plain module: netpart's one-worker training step against the plain
PyTorch module of the same model, its forward and backward, and with the optimizer's update
(fused Adagrad, or SGD). The plain module is the user's own for a module `--model`
(FILE.py:NAME with `--input`), else netpart's reference module (`netpart.models.
build_reference`, what a user would train or wrap in DDP).

One thread of this host, batch 32, float32; CPU seconds a step, the cases alternated in
`--rounds` rounds of `--steps` steps after a warm-up (`benchmarks/harness.py`), medians.

    python benchmarks/step_bench.py --model bench-local
    python benchmarks/step_bench.py --model tests/models/user_models.py:VGGish \
        --input 3x32x32 --update sgd
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import parser, write_results

from netpart.models import build_reference, load_spec
from netpart.models.importer import is_module_target, load_module
from netpart.models.reference import reference_loss
from netpart.partition.planner import plan
from netpart.runtime.check import lone_step, make_batch
from netpart.timing import alternate


def main(argv=None) -> int:
    ap = parser("step_bench", __doc__)
    ap.add_argument("--model", default="bench-local")
    ap.add_argument("--input", default=None, help="a module --model's example shape (3x32x32)")
    ap.add_argument("--update", choices=["adagrad", "sgd"], default="adagrad")
    ap.add_argument("--steps", type=int, default=5, help="steps a round (default 5)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as netpart's training processes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = load_spec(args.model, input=args.input)
    netpart_step = lone_step(spec, plan(spec, 1, seed=0, batch=32), dist.group.WORLD, 0)
    mine = is_module_target(args.model)
    model = (load_module(args.model) if mine else build_reference(spec)).float()
    if args.update == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.01, fused=True)
    x, y = make_batch(spec, 32, 0)
    x = x.float().reshape(32, *spec.input.dims)

    def backward() -> None:
        opt.zero_grad()
        reference_loss(spec, model(x), y).backward()

    def with_update() -> None:
        backward()
        opt.step()

    def steps(fn):
        return lambda: [fn() for _ in range(args.steps)]

    cases = {"netpart": netpart_step, "reference": backward, "reference+update": with_update}
    rounds = alternate({k: steps(f) for k, f in cases.items()}, rounds=args.rounds)
    dist.destroy_process_group()
    base = rounds.median_cpu("netpart")
    for name in rounds.names:
        cpu = rounds.median_cpu(name) / args.steps
        ratio = rounds.median_cpu(name) / base
        print(f"{name:<17} {cpu * 1e3:8.2f} ms CPU a step, {ratio:.2f}x netpart's")
    results = {"model": args.model, "input": args.input, "update": args.update}
    results |= {"plain": "the user's module" if mine else "the reference", "steps": args.steps}
    results |= rounds.to_dict()
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
