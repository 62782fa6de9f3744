"""A step against the plain module: netpart's one-worker training step against the plain
PyTorch module of the same model, its forward and backward, and with the optimizer's update
(fused Adagrad, or SGD). The plain module is the user's own for a module (`--model
package.module:NAME@SHAPE`, read as `netpart --model package.module:NAME --input SHAPE`
reads it), else netpart's reference module (`netpart.models.build_reference`, what a user
would train or wrap in DDP).

One thread of this host, batch 32, float32; CPU seconds a step, the cases alternated in
`--rounds` rounds of `--steps` steps after a warm-up (`benchmarks/harness.py`), medians; one
model after another.

    python benchmarks/step_bench.py --model bench-local
    python benchmarks/step_bench.py --update sgd --rounds 9 --steps 8 \
        --model tests.models.user_models:VGGish@3x32x32 \
        --model tests.models.user_models:LeNet5@1x28x28 \
        --model tests.models.user_models:distbelief@3x16x16
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
    ap.add_argument(
        "--model",
        action="append",
        help="a zoo model, or a module as NAME@SHAPE (tests.models.user_models:VGGish@3x32x32); "
        "again for another (default bench-local)",
    )
    ap.add_argument("--update", choices=["adagrad", "sgd"], default="adagrad")
    ap.add_argument("--steps", type=int, default=5, help="steps a round (default 5)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as netpart's training processes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs = [_model_run(model, args) for model in args.model or ["bench-local"]]
    dist.destroy_process_group()
    write_results(args.out, {"update": args.update, "steps": args.steps, "runs": runs})
    return 0


def _model_run(model: str, args) -> dict:
    """One model's cases, alternated: netpart's step, the plain module's forward and
    backward, and with the update."""
    target, _, shape = model.partition("@")
    spec = load_spec(target, input=shape or None)
    netpart_step = lone_step(spec, plan(spec, 1, seed=0, batch=32), dist.group.WORLD, 0)
    mine = is_module_target(target)
    module = (load_module(target) if mine else build_reference(spec)).float()
    if args.update == "sgd":
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
    else:
        opt = torch.optim.Adagrad(module.parameters(), lr=0.01, fused=True)
    x, y = make_batch(spec, 32, 0)
    x = x.float().reshape(32, *spec.input.dims)

    def backward() -> None:
        opt.zero_grad()
        reference_loss(spec, module(x), y).backward()

    def with_update() -> None:
        backward()
        opt.step()

    def steps(fn):
        return lambda: [fn() for _ in range(args.steps)]

    cases = {"netpart": netpart_step, "reference": backward, "reference+update": with_update}
    rounds = alternate({k: steps(f) for k, f in cases.items()}, rounds=args.rounds)
    base = rounds.median_cpu("netpart")
    for name in rounds.names:
        cpu = rounds.median_cpu(name) / args.steps
        ratio = rounds.median_cpu(name) / base
        print(f"{model}: {name:<17} {cpu * 1e3:8.2f} ms CPU a step, {ratio:.2f}x netpart's")
    plain = "the user's module" if mine else "the reference"
    return {"model": target, "input": shape or None, "plain": plain, **rounds.to_dict()}


if __name__ == "__main__":
    raise SystemExit(main())
