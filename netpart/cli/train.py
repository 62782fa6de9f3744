"""`netpart train | eval | report | export`: training jobs and what their runs hold."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from netpart.cli.common import (
    add_force_arg,
    add_model_args,
    add_profile_arg,
    check_writable,
    echo,
    positive_int,
    seed_int,
    timeout_s,
)
from netpart.cli.testbed import add_testbed_arg
from netpart.cost.sheet import load_machine

__all__ = ["register"]

EPILOG_TRAIN = """\
the job: R replicas x N model workers + S parameter-server shards = R*N+S processes
  (+1 coordinator with --mode sandblaster, where --steps counts L-BFGS iterations and
  every evaluation covers the same --batch examples, cut into --units work units),
  spawned on this machine, or started by torchrun on one or more machines with
  WORLD_SIZE = R*N+S (every process runs this same command; see docs/multi-node.md).
  --placement pack keeps each replica's workers on as few machines as possible and spreads
  the shards; spread puts worker w on machine w mod K; ordered makes rank r*N+w worker w of
  replica r and rank R*N+s shard s (on one machine every policy gives this order).

in --out DIR:
  train.json, spec.json, plan.json, node_map.npy   the job (a resume must match them)
  shard_<s>.pt (+ .json)   parameters and optimizer state, written atomically every
                           --checkpoint-every updates and at the end
  metrics_replica<r>.jsonl one line per step of replica r: time, loss, accuracy, staleness,
                           samples, step time split into compute / halo / ps / data, bytes
  metrics.jsonl            all replicas' lines in time order (written at the end)
  model.pt                 the trained state_dict (torch.load weights_only=True): your
                           module's, under its names (--model net.py:Net), else the
                           reference module's
  summary.json             last step and loss per replica, lost replicas, held-out figures
  report.md, curves.png, step_time.png, staleness.png   (`netpart report DIR` redraws them)
  sandblaster.jsonl, coordinator.json   Sandblaster: loss, units per replica and backups
                           per evaluation; the totals and the L-BFGS losses
  logs/rank<k>.log

examples:
  netpart train --model tiny-local --workers 2 --replicas 2 --ps-shards 2 --steps 200
  netpart train --model tiny-local --workers 2 --replicas 2 --data digits --steps 300
  netpart train --model image-80m --workers 4 --replicas 1 --data shapes --batch 16
  netpart train --model tiny-local --workers 2 --data my_images/ --steps 500
  netpart train --model tiny-local --workers 2 --replicas 4 --mode sync --optimizer sgd
  netpart train --model tiny-local --workers 2 --replicas 2 --mode sandblaster \\
      --optimizer lbfgs --lr 1 --data digits --batch 1438 --units 16 --steps 15
  netpart train --resume out/train --steps 400       # continue a run to 400 steps
"""


def register(sub) -> None:
    """Add `train`, `eval`, `report` and `export` to the subcommands."""
    _train_parser(sub)
    _run_parsers(sub)


def _train_parser(sub) -> None:
    from netpart.partition.methods import METHODS

    t = sub.add_parser(
        "train",
        help="train a partitioned model: R replicas against a sharded parameter server",
        description="Train MODEL split across WORKERS model workers (lockstep halo exchange), "
        "with REPLICAS copies of it pushing gradients to and fetching parameters from PS-SHARDS "
        "parameter-server shards: Downpour SGD (asynchronous) or synchronous SGD. A replica "
        "that dies is dropped and training goes on; SIGINT/SIGTERM stop at a step boundary "
        "with a final checkpoint.",
        epilog=EPILOG_TRAIN,
    )
    add_model_args(t, required=False, default=" (default on --resume: the run's)")
    t.add_argument(
        "--workers",
        type=int,
        default=None,
        help="model workers per replica (N; required for a new run)",
    )
    _config_flags(t)
    t.add_argument(
        "--method",
        default="auto",
        choices=["auto", *METHODS],
        help="partitioner (default auto: the lowest predicted step; see `netpart plan --help`)",
    )
    t.add_argument(
        "--plan", type=Path, default=None, help="use this plan directory (default: plan afresh)"
    )
    add_profile_arg(t)
    _where_flags(t)
    add_force_arg(t)
    add_testbed_arg(t, processes=_processes)
    t.set_defaults(func=cmd_train, torch=True)


def _where_flags(t: argparse.ArgumentParser) -> None:
    """Where `netpart train` writes, how it reports, what it resumes, how many machines."""
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="run directory of a new run (default: out/train); a resume continues in its own",
    )
    t.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="off a terminal (CI, nohup, > log): a progress line on stdout this often",
    )
    t.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue this run (in DIR) up to --steps; --out is refused",
    )
    t.add_argument(
        "--machines",
        type=positive_int,
        default=None,
        metavar="M",
        help="instead of --workers, --replicas, --ps-shards and --mode: train the fastest "
        "parameter-server layout `netpart plan --machines M` predicts for M machines like "
        "this one (or --profile/--machine)",
    )


def _config_flags(t: argparse.ArgumentParser) -> None:
    """The TrainConfig fields as flags whose absence means "the default, or the run's",
    grouped in `--help` by what they set."""
    from netpart.train.config import TrainConfig

    defaults = TrainConfig()
    flag = _config_flag(t.add_argument_group("replicas, shards and processes"), defaults)
    flag("replicas", int, "replicas of the model (R)")
    flag("shards", int, "parameter-server shards (S; default: N)", name="--ps-shards")
    flag("mode", str, "downpour | sync | sandblaster (batch L-BFGS with a coordinator)")
    flag("placement", str, "pack | spread | ordered: which ranks play which role")
    flag("threads", int, "torch threads per process")
    flag = _config_flag(t.add_argument_group("the optimizer"), defaults)
    flag("optimizer", str, "adagrad | sgd | lbfgs (with --mode sandblaster)")
    flag("lr", float, "learning rate (default: 0.01 for adagrad, 0.05 for sgd, 1 for lbfgs)")
    flag("n_fetch", int, "downpour: fetch parameters every K steps")
    flag("n_push", int, "downpour: push gradients every K steps")
    flag("push_norm", float, "downpour: push sooner once the gradient's L2 norm reaches this")
    flag("dc_lambda", float, "downpour: DC-ASGD delay compensation lambda (0: off)")
    flag(
        "local_update",
        str,
        "downpour with sgd: auto | on | off: a replica also applies each step to its own "
        "parameters (the paper's client), and fetched values get its pushes they do not "
        "reflect yet; with one replica that is exactly single-process SGD (auto: on for sgd)",
    )
    flag("warm_start", int, "downpour: steps replica 0 trains alone first")
    flag = _config_flag(t.add_argument_group("Sandblaster L-BFGS"), defaults)
    flag("units", int, "work units per batch", "--units", "--units-per-batch")
    flag("history", int, "L-BFGS curvature pairs kept in the shards")
    flag("line_search", str, "armijo | none (torch.optim.LBFGS's fixed step)")
    _data_flags(_config_flag(t.add_argument_group("the data"), defaults))
    _run_flags(_config_flag(t.add_argument_group("the run"), defaults))


def _data_flags(flag) -> None:
    """The TrainConfig fields of the data a job reads."""
    flag(
        "data",
        str,
        "synthetic; shapes (procedural images at the model's resolution); digits (sklearn's "
        "bundled digits); a .npz with x, y [x_test, y_test]; or a folder of class subfolders "
        "of images (20%% held out where no test set is given)",
    )
    flag(
        "data_layout",
        str,
        "nchw | nhwc: how an image model's .npz x is laid out (nhwc: channels last, "
        "transposed to channels first)",
        "--layout",
    )
    flag("batch", int, "examples per step and replica")
    flag("seed", seed_int, "weights, data and partitioner seed")
    flag(
        "init",
        str,
        "seed | module: start from netpart's seeded weights, or from those your module "
        "(--model FILE.py:NAME) is built with after torch.manual_seed(--seed)",
    )


def _run_flags(flag) -> None:
    """The TrainConfig fields of the job's length, checkpoints, evaluation and faults."""
    flag("steps", int, "total steps per replica (a resume continues up to it)")
    flag("checkpoint_every", int, "shard updates between checkpoints")
    flag("snapshot_every", int, "keep a copy of every shard each K updates in snapshots/ (0: off)")
    flag(
        "eval_every",
        int,
        "replica 0 evaluates on held-out examples every K steps and at the last one "
        "(eval.jsonl, the held-out curve in curves.png; 0: once, after training)",
    )
    flag(
        "log",
        str,
        "loggers besides the run's JSON lines, comma-separated: csv (metrics.csv, eval.csv), "
        "tensorboard (RUN/tensorboard; needs the tensorboard package)",
    )
    flag("dtype", str, "float32 | float64")
    flag("timeout", timeout_s, "seconds a worker waits for a peer before giving up")
    flag(
        "restarts",
        int,
        "times a parameter-server shard that dies (killed, crashed) is restarted from its "
        "last checkpoint with the whole job (downpour, sync; under torchrun, torchrun's "
        "--max-restarts restarts it)",
    )


def _run_parsers(sub) -> None:
    """`eval`, `report` and `export`: what a run directory holds."""
    v = sub.add_parser(
        "eval",
        help="evaluate a run's model on held-out data",
        description="Load the model of a training run (its model.pt, or the shard checkpoints) "
        "into the single-process reference module and report loss and accuracy on the "
        "held-out part of --data (never trained on: a fixed 20% of digits, .npz and folders, "
        "the npz's x_test/y_test when given, 1,000 extra examples of synthetic and shapes).",
    )
    v.add_argument("run", type=Path, help="run directory of `netpart train`")
    v.add_argument("--data", default=None, help="(default: the data the run trained on)")
    v.add_argument("--batch", type=positive_int, default=256, help="examples per forward pass")
    v.set_defaults(func=cmd_eval, torch=True)

    rp = sub.add_parser(
        "report",
        help="redraw a run's plots and Markdown report",
        description="Read RUN's metrics files and shard sidecars and write metrics.jsonl, "
        "curves.png (loss and accuracy vs wall time per replica), step_time.png (compute / halo "
        "exchange / parameter server / data per step), staleness.png (Downpour: updates between "
        "a fetch and the push computed on it) and report.md. Works on a run still in progress.",
    )
    rp.add_argument("run", type=Path, help="run directory of `netpart train`")
    rp.set_defaults(func=cmd_report)

    e = sub.add_parser(
        "export",
        help="write a run's model for plain PyTorch (torch.export program or state_dict)",
        description="Read the shard checkpoints of RUN and write the trained model. "
        "--format program (the default) writes a torch.export program that plain PyTorch "
        "loads and runs without netpart:\n\n"
        "    model = torch.export.load('RUN/model.pt2').module()\n"
        "    logits = model(x)   # x: [batch, C, H, W] (or [batch, features]), float32\n\n"
        "--format state_dict writes a state_dict (torch.load(weights_only=True)): for a run "
        "of your own nn.Module (--model net.py:Net) under its parameter names, so that "
        "Net().load_state_dict(torch.load(path)) loads it without netpart; for a zoo or spec "
        "model, the reference module's (netpart.models.build_reference builds it).",
    )
    e.add_argument("run", type=Path, help="run directory of `netpart train`")
    e.add_argument(
        "--format",
        choices=["program", "state_dict"],
        default="program",
        help="program: a torch.export program (.pt2); state_dict: your module's (or the "
        "reference module's)",
    )
    e.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="file to write (default: RUN/model.pt2, or RUN/model.pt for state_dict)",
    )
    e.set_defaults(func=cmd_export, torch=True)


def _config_flag(parser, defaults):
    """Add a TrainConfig field as a flag whose absence means "the default, or the run's"."""

    def add(field: str, kind, text: str, name: str | None = None, *aliases: str) -> None:
        default = defaults.get(field)
        extra = "" if field == "shards" or default is None else f" (default {default})"
        parser.add_argument(
            name or "--" + field.replace("_", "-"),
            *aliases,
            dest=field,
            type=kind,
            default=None,
            help=text + extra,
        )

    return add


def _processes(args: argparse.Namespace) -> int | None:
    """The processes the job takes (None: a resume's or a saved plan's to say)."""
    if args.resume is not None or args.plan is not None:
        return None
    if args.machines is not None:  # a layout of exactly M machines
        return args.machines
    from netpart.train.config import TrainConfig

    if args.workers is None:
        return None  # the job says what is missing
    config = TrainConfig.of(**{"shards": args.workers, **_given(args)})
    return config.world(args.workers)


def _given(args: argparse.Namespace) -> dict:
    """The job's config fields given on the command line."""
    from netpart.train.job import FIELDS

    return {k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}


def _request(args: argparse.Namespace):
    """The flags as a `TrainRequest` (the job's rules are the train room's)."""
    from netpart.train.job import TrainRequest

    given = _given(args)
    network = None
    if args.resume is None and args.plan is None:
        network = load_machine(args.profile, machine=args.machine)
    return TrainRequest(
        model=args.model,
        input=args.input,
        workers=args.workers,
        given=given,
        method=args.method,
        plan=args.plan,
        network=network,
        out=args.out,
        resume=args.resume,
        force=args.force,
    )


def cmd_train(args: argparse.Namespace) -> int:
    from netpart.train.job import DEFAULT_OUT, train_here, train_torchrun, under_torchrun

    if args.resume is None:
        check_writable(args.out or DEFAULT_OUT, "--out")
    if args.machines is not None:
        from netpart.cli.machines import train_layout

        train_layout(args)
    request = _request(args)
    if under_torchrun():
        code = train_torchrun(request, echo)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # peers' gloo threads may still block: do not wait for them
    from tqdm import tqdm

    from netpart.train.launch import ProgressLines, postfix

    lines = None if sys.stdout.isatty() else ProgressLines(args.progress_every, say=echo)
    with tqdm(total=0, desc="train", unit="step", disable=not sys.stderr.isatty()) as bar:

        def progress(done: int, stats: dict, total: int) -> None:
            replicas = stats.get("replicas", 1) if stats else 1
            bar.total, bar.n = total // replicas, done // replicas  # steps per replica
            if stats:
                bar.set_postfix_str(postfix(stats), refresh=False)
            bar.refresh()
            if lines is not None:
                lines(done, stats, total)

        job, summary = train_here(request, on_start=tqdm.write, on_progress=progress)
    for line in summary_lines(summary, job.config.data.source):
        echo(line)
    echo(
        f"wrote {job.run}/model.pt and shard checkpoints ({summary.wall_s:.1f} s); "
        f"report: {job.run}/report.md"
    )
    if summary.stopped:  # Ctrl-C or SIGTERM: say how to go on
        from netpart.train.watch import resume_hint

        echo(f"stopped at a step boundary: {resume_hint(job.run, job.config)}")
    return 130 if summary.stopped else 0


def summary_lines(summary, data: str) -> list[str]:
    """What a finished job says: each replica's last step and loss, lost replicas, restarts,
    held-out figures."""
    from netpart.train.launch import held_out_line
    from netpart.train.run_report import restart_line

    lines = [
        f"replica {r}: step {summary.steps[r]}, loss {summary.final_loss[r]:.4g}"
        for r in sorted(summary.final_loss)
    ]
    lines += [f"replica {r} was lost: {why}" for r, why in summary.lost.items()]
    lines += [restart_line(restart) for restart in summary.restarts]
    if summary.held_out:
        lines.append(held_out_line(summary.held_out, data))
    return lines


def cmd_eval(args: argparse.Namespace) -> int:
    from netpart.train.run_report import evaluate
    from netpart.train.rundir import run_model

    run = args.run
    job, state = run_model(run)
    spec, config = job.spec, job.config
    source = args.data or config.data.source
    data = config.dataset(spec, source)
    x, y = data.held_out_set()
    result = evaluate(spec, state, x, y, seed=config.run.seed, batch=args.batch)
    accuracy = f", accuracy {result['accuracy']:.4f}" if "accuracy" in result else ""
    echo(
        f"{spec.name} from {run} on {source} (held-out, {len(x)} examples): "
        f"loss {result['loss']:.4f}{accuracy}"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from netpart.train.run_report import write_report
    from netpart.train.rundir import read_job

    read_job(args.run)  # a clear error for a directory that is not a run
    path = write_report(args.run)
    echo(f"wrote {path} and its plots")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import io
    import json

    import torch

    from netpart.files import write_atomic
    from netpart.models.reference import exported_program
    from netpart.ps.checkpoint import save_model
    from netpart.train.rundir import run_model, user_state

    job, state = run_model(args.run, from_shards=True)
    config = job.config
    count = f"{job.spec.num_params:,} parameters"  # not a batch norm's running statistics
    recorded = args.run / "data.json"  # how the model was fed, what its outputs mean
    if recorded.is_file():
        fed = json.loads(recorded.read_text())
    else:  # a run that ended before writing it
        data = config.dataset(job.spec)
        fed = data.preprocessing()
    about = json.dumps({"model": job.spec.name, **fed}, indent=1)
    if args.format == "state_dict":
        out = args.out or args.run / "model.pt"
        save_model(out, user_state(job.spec, state))  # an imported model's: in its names
        write_atomic(out.with_name(out.name + ".json"), about.encode())
        whose = (
            f"your {job.spec.name}'s state_dict (load_state_dict into it)"
            if job.spec.state_names()
            else f"{job.spec.name}'s reference state_dict"
        )
        echo(
            f"wrote {out}: {whose}, {count}; how it was fed ({fed['input']}) and its class "
            f"names: {out}.json"
        )
        return 0
    out = args.out or args.run / "model.pt2"
    check_writable(out, "--out")
    buf = io.BytesIO()
    standard = fed["standardised"]
    standardised = (standard["mean"], standard["std"]) if standard else None
    program = exported_program(job.spec, state, standardised)
    torch.export.save(program, buf, extra_files={"netpart.json": about})
    write_atomic(out, buf.getvalue())
    takes = "pixels in [0, 1], standardised inside" if standardised else "inputs as trained"
    echo(
        f"wrote {out}: {job.spec.name}, {count}, takes {takes}; load it with "
        f"torch.export.load({str(out)!r}).module(); its class names and standardisation: "
        "the extra file netpart.json"
    )
    return 0
