"""`netpart train` and `netpart export`: the training half of the command line (thin)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from netpart.errors import PlanError

EPILOG_TRAIN = """\
the job: R replicas x N model workers + S parameter-server shards = R*N+S processes
  (worker w of replica r is rank r*N+w, shard s is rank R*N+s). Spawned on this machine,
  or started by torchrun with WORLD_SIZE = R*N+S (every process runs this same command).

in --out DIR:
  train.json, spec.json, plan.json, node_map.npy   the job (a resume must match them)
  shard_<s>.pt (+ .json)   parameters and optimizer state, written atomically every
                           --checkpoint-every updates and at the end
  metrics_replica<r>.jsonl one line per step: step, loss, seconds since start
  model.pt                 the reference module's state_dict (torch.load weights_only=True)
  summary.json, logs/rank<k>.log

examples:
  netpart train --model tiny-local --workers 2 --replicas 2 --ps-shards 2 --steps 200
  netpart train --model tiny-local --workers 2 --replicas 2 --data digits --steps 300
  netpart train --model tiny-local --workers 2 --replicas 4 --mode sync --optimizer sgd
  netpart train --resume out/train --steps 400       # continue a run to 400 steps
"""


def add_parsers(sub) -> None:
    from netpart.partition.methods import METHODS
    from netpart.runtime.config import TrainConfig

    d = TrainConfig()
    t = sub.add_parser(
        "train",
        help="train a partitioned model: R replicas against a sharded parameter server",
        description="Train MODEL split across WORKERS model workers (lockstep halo exchange), "
        "with REPLICAS copies of it pushing gradients to and fetching parameters from PS-SHARDS "
        "parameter-server shards: Downpour SGD (asynchronous) or synchronous SGD. A replica "
        "that dies is dropped and training goes on; SIGINT/SIGTERM stop at a step boundary "
        "with a final checkpoint.",
        epilog=EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--model", default=None, help="zoo name or .toml/.json (default on --resume)")
    t.add_argument("--workers", type=int, default=None, help="model workers per replica (N)")
    flag = _config_flag(t, d)
    flag("replicas", int, "replicas of the model (R)")
    flag("shards", int, "parameter-server shards (S; default: N)", name="--ps-shards")
    flag("mode", str, "downpour | sync")
    flag("optimizer", str, "adagrad | sgd")
    flag("lr", float, "learning rate")
    flag("n_fetch", int, "downpour: fetch parameters every K steps")
    flag("n_push", int, "downpour: push gradients every K steps")
    flag("steps", int, "total steps per replica (a resume continues up to it)")
    flag("batch", int, "examples per step and replica")
    flag("warm_start", int, "downpour: steps replica 0 trains alone first")
    flag("checkpoint_every", int, "shard updates between checkpoints")
    flag(
        "data",
        str,
        "synthetic; digits (sklearn's bundled digits, 20%% held out); or a .npz with x, y",
    )
    flag("seed", int, "weights, data and partitioner seed")
    flag("dtype", str, "float32 | float64")
    flag("timeout", float, "seconds a worker waits for a peer before giving up")
    flag("threads", int, "torch threads per process")
    t.add_argument("--method", default="metis", choices=list(METHODS), help="partitioner")
    t.add_argument("--plan", type=Path, default=None, help="use this plan directory")
    t.add_argument("--out", type=Path, default=Path("out/train"), help="run directory")
    t.add_argument("--resume", type=Path, default=None, metavar="DIR", help="continue this run")

    v = sub.add_parser(
        "eval",
        help="evaluate a run's model on held-out data",
        description="Load the model of a training run (its model.pt, or the shard checkpoints) "
        "into the single-process reference module and report loss and accuracy on the "
        "held-out part of --data (digits: the fixed 20%%), or on every example of a .npz.",
    )
    v.add_argument("--checkpoint", type=Path, required=True, metavar="RUN", help="run directory")
    v.add_argument("--data", default=None, help="default: the data the run trained on")
    v.add_argument("--batch", type=int, default=256, help="examples per forward pass")

    e = sub.add_parser(
        "export",
        help="write a run's parameters as the reference module's state_dict",
        description="Read the shard checkpoints of RUN and write the single-process reference "
        "module's state_dict (load it with torch.load(weights_only=True)).",
    )
    e.add_argument("run", type=Path, help="run directory of `netpart train`")
    e.add_argument("--output", type=Path, default=None, help="default: RUN/model.pt")


def _config_flag(parser, defaults):
    """Add a TrainConfig field as a flag whose absence means "the default, or the run's"."""

    def add(field: str, kind, text: str, name: str | None = None) -> None:
        default = getattr(defaults, field)
        extra = "" if field == "shards" else f" (default {default})"
        parser.add_argument(
            name or "--" + field.replace("_", "-"), dest=field, type=kind, default=None,
            help=text + extra,
        )  # fmt: skip

    return add


_FIELDS = (
    "replicas", "shards", "mode", "optimizer", "lr", "n_fetch", "n_push", "steps", "batch",
    "warm_start", "checkpoint_every", "data", "seed", "dtype", "timeout", "threads",
)  # fmt: skip
_FIXED_ON_RESUME = ("shards", "optimizer", "dtype", "seed", "data")


def _flag(field: str) -> str:
    return "ps-shards" if field == "shards" else field.replace("_", "-")


def _job(args):
    """Spec, plan and config from the flags, or from the run directory with --resume."""
    from netpart.files import load_plan
    from netpart.models import load_spec
    from netpart.partition import plan
    from netpart.runtime.checkpoint import read_run
    from netpart.runtime.config import TrainConfig, TrainError

    if args.resume is not None:
        run = args.resume
        manifest, spec, old = read_run(run)
        if args.model is not None and load_spec(args.model).fingerprint() != spec.fingerprint():
            raise TrainError(f"--resume {run}: the run trained {spec.name}, not {args.model}")
        if args.workers is not None and args.workers != manifest.get("workers"):
            raise TrainError(
                f"--workers {args.workers}: the run in {run} has {manifest.get('workers')} "
                "workers per replica; resume with the same layout or start a new --out"
            )
        for k in _FIXED_ON_RESUME:
            given = getattr(args, k)
            if given is not None and given != getattr(old, k):
                raise TrainError(
                    f"--{_flag(k)} {given}: the run in {run} has {getattr(old, k)}; "
                    "resume with the same value or start a new --out"
                )
        given = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
        config = TrainConfig.from_dict({**old.to_dict(), **given})
        return spec, load_plan(run, spec), config, run
    if args.model is None or args.workers is None:
        raise TrainError("--model and --workers are required (or --resume DIR)")
    if args.workers < 1:
        raise TrainError(f"--workers {args.workers}: must be an integer >= 1")
    spec = load_spec(args.model)
    given = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
    given.setdefault("shards", args.workers)
    config = TrainConfig.from_dict(given, "command line")
    from netpart.data import load_data

    load_data(config.data, spec, config.seed, config.examples)  # bad data fails before planning
    if args.plan is not None:
        p = load_plan(args.plan, spec)
        if p.workers != args.workers:
            raise PlanError(f"{args.plan}: the plan is for {p.workers} workers, not {args.workers}")
    else:
        p = plan(spec, args.workers, args.method, seed=config.seed, batch=config.batch)
    return spec, p, config, args.out


def cmd_train(args: argparse.Namespace, echo: Callable[[str], None]) -> int:
    """Run `netpart train`; `echo` writes a line of output (the CLI passes `print`)."""
    from netpart.runtime.config import TrainError

    spec, p, config, run = _job(args)
    if os.environ.get("RANK") is not None and os.environ.get("TORCHELASTIC_RUN_ID"):
        return _train_under_torchrun(spec, p, config, run, args.resume is not None, echo)
    from netpart.runtime.train_launch import train

    if run.exists() and not run.is_dir():
        raise TrainError(f"--out {run}: exists and is not a directory")
    world = config.world(p.workers)
    banner = (
        f"{spec.name}: {config.replicas} replica(s) x {p.workers} worker(s) + {config.shards} "
        f"shard(s) = {world} processes, {config.mode}, {config.optimizer} lr {config.lr}; "
        f"run directory {run}"
    )
    with tqdm(total=0, desc="train", unit="step", disable=None) as bar:

        def progress(done: int, total: int) -> None:
            if bar.total == 0:  # the first call comes once the job is validated and started
                tqdm.write(banner)
            bar.total = total
            bar.n = done
            bar.refresh()

        summary = train(spec, p, config, run, resume=args.resume is not None, on_progress=progress)
    for r in sorted(summary.final_loss):
        echo(f"replica {r}: step {summary.steps[r]}, loss {summary.final_loss[r]:.4g}")
    for r, why in summary.lost.items():
        echo(f"replica {r} was lost: {why}")
    echo(f"wrote {run}/model.pt and shard checkpoints ({summary.wall_s:.1f} s)")
    return 130 if summary.stopped else 0


def _train_under_torchrun(spec, p, config, run: Path, resume: bool, echo) -> int:
    """Every torchrun process runs this: join the group and play the role of its RANK."""
    import torch
    import torch.distributed as dist

    from netpart.runtime.checkpoint import read_progress
    from netpart.runtime.config import TrainError
    from netpart.runtime.train_launch import _write_run, prepare_run
    from netpart.runtime.train_main import stop_on_signals
    from netpart.runtime.trainer import PS_TIMEOUT, run_process

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != config.world(p.workers):
        raise TrainError(
            f"torchrun started {world} processes; this job needs replicas x workers + shards = "
            f"{config.world(p.workers)}"
        )
    run.mkdir(parents=True, exist_ok=True)
    first_shard = config.replicas * p.workers
    if rank == first_shard:  # validates the run directory, then writes the run files
        _, starts = prepare_run(spec, p, config, run, resume)
        _write_run(spec, p, config, run, starts, resume)
    sync = config.mode == "sync"
    starts = read_progress(run, config.shards, config.replicas, sync) if resume else {}
    torch.set_num_threads(config.threads)
    stop = stop_on_signals()
    dist.init_process_group("gloo", timeout=PS_TIMEOUT)
    try:
        run_process(rank, spec, p, config, run, starts, resume, stop)
    finally:
        sys.stderr.flush()
    if rank < first_shard and rank % p.workers == 0:
        lines = (run / f"metrics_replica{rank // p.workers}.jsonl").read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {"step": 0, "loss": float("nan")}
        echo(f"replica {rank // p.workers}: step {last['step']}, loss {last['loss']:.4g}")
    elif rank == first_shard:
        echo(f"shard checkpoints in {run}; `netpart export {run}` writes the model")
    sys.stdout.flush()
    os._exit(0)


def cmd_eval(args: argparse.Namespace, echo: Callable[[str], None]) -> int:
    import torch

    from netpart.data import load_data
    from netpart.models.reference import build_reference
    from netpart.runtime.config import TrainError

    run = args.checkpoint
    spec, config, state = _run_model(run)
    source = args.data or config.data
    data = load_data(source, spec, config.seed, config.examples)
    if data.held_out is not None:
        x, y, part = *data.held_out, "held-out"
    elif data.x is not None:
        x, y, part = data.x, data.y, "all"
    else:
        raise TrainError(f"--data {source}: has no held-out examples; pass digits or a .npz")
    model = build_reference(spec, config.seed)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(x), max(1, args.batch)):
            xb = torch.from_numpy(x[lo : lo + args.batch]).float()
            yb = torch.from_numpy(y[lo : lo + args.batch])
            out = model(xb)
            loss_sum += float(model.loss(out, yb)) * len(xb)
            if spec.loss == "cross_entropy":
                correct += int((out.flatten(1).argmax(1) == yb).sum())
    accuracy = f", accuracy {correct / len(x):.4f}" if spec.loss == "cross_entropy" else ""
    echo(f"{spec.name} from {run} on {source} ({part}, {len(x)} examples): "
         f"loss {loss_sum / len(x):.4f}{accuracy}")  # fmt: skip
    return 0


def _run_model(run: Path, from_shards: bool = False):
    """(spec, config, reference state_dict) of a run: model.pt if there is one (unless
    `from_shards`), else the shard checkpoints."""
    import torch

    from netpart.files import load_plan
    from netpart.partition import build_unit_graph
    from netpart.partition.shards import ShardLayout
    from netpart.runtime.checkpoint import model_from_shards, read_run
    from netpart.runtime.config import TrainError

    _, spec, config = read_run(run)
    if not from_shards and (run / "model.pt").exists():
        try:
            return spec, config, torch.load(run / "model.pt", weights_only=True)
        except Exception as exc:  # a torn or foreign file
            raise TrainError(f"{run / 'model.pt'}: not readable ({exc})") from None
    p = load_plan(run, spec)
    layout = ShardLayout.build(
        build_unit_graph(spec, p.granularity), p.node_map, p.workers, config.shards
    )
    return spec, config, model_from_shards(spec, p, config, run, layout)


def cmd_export(args: argparse.Namespace, echo: Callable[[str], None]) -> int:
    from netpart.runtime.checkpoint import save_model

    spec, _, state = _run_model(args.run, from_shards=True)
    out = args.output or args.run / "model.pt"
    save_model(out, state)
    echo(f"wrote {out}: {spec.name}, {sum(v.numel() for v in state.values()):,} parameters")
    return 0
