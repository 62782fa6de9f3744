"""`netpart plan --sweep COUNTS` and `netpart plan --machines M`: how many workers one model
instance is worth, and how to spend M machines on replicas, workers and shards (or
all-reduce). Both are predictions of the step-time model; no process is started.
`netpart train --machines M` trains the fastest layout `plan --machines M` lists that
netpart runs (`train_layout`)."""

from __future__ import annotations

import argparse
import sys

from netpart.cli.common import check_writable, echo, positive_int
from netpart.errors import PlanError
from netpart.processes.memory import available_memory

__all__ = ["machines_options", "plan_cluster", "sweep", "train_layout"]


def machines_options(p: argparse.ArgumentParser) -> None:
    """--sweep and the gain its knee is read at; --machines and what it weighs."""
    p.add_argument(
        "--sweep",
        default=None,
        metavar="COUNTS",
        help="instead of --workers: plan at every worker count of COUNTS ('1,2,4,8' or "
        "'1-128', powers of two) and print the predicted step and speedup at each, the knee "
        "(the last count whose doubling still made the step --gain times faster) and the "
        "fastest count; with --out also sweep.json and sweep.png",
    )
    p.add_argument("--gain", type=float, default=1.25, help="--sweep: the gain a doubling must buy")
    p.add_argument(
        "--machines",
        type=positive_int,
        default=None,
        metavar="M",
        help="instead of --workers: how to spend M machines: every layout of R replicas x N "
        "workers + S shards (Downpour and sync) and all-reduce over M replicas, predicted "
        "(step, samples/s, epoch time, busiest link, memory, staleness), the fastest "
        "recommended; with --out also cluster.json, cluster.png and report.md",
    )
    p.add_argument(
        "--examples",
        type=positive_int,
        default=60000,
        help="--machines: examples per epoch, for the time per epoch",
    )
    p.add_argument(
        "--n-push", type=positive_int, default=1, help="--machines: Downpour pushes every N steps"
    )
    p.add_argument(
        "--n-fetch",
        type=positive_int,
        default=1,
        help="--machines: Downpour fetches every N steps",
    )


def _check_out(out, name: str) -> None:
    """`--out` holds nothing but an earlier `name` and is writable (before any work)."""
    from netpart.files import foreign_entries

    if out is not None and (found := foreign_entries(out, name)):
        raise PlanError(f"--out {out}: not empty (holds {', '.join(found)})")
    if out is not None:
        check_writable(out, "--out")


def sweep(spec, args: argparse.Namespace, network) -> int:
    """`plan --sweep`: one plan per worker count, its predicted step, the knee."""
    import json

    from tqdm import tqdm

    from netpart.files import write_files
    from netpart.planning.pictures import sweep_png
    from netpart.planning.report import sweep_table
    from netpart.planning.sweep import parse_counts, spreadable
    from netpart.planning.sweep import sweep as run_sweep

    try:
        counts = parse_counts(args.sweep)
    except ValueError as exc:
        raise PlanError(f"--sweep {exc}") from None
    _check_out(args.out, "sweep.json")
    counts, note = spreadable(spec, counts, args.blocks_per_worker)
    if note is not None:
        echo(note)
    sweep = run_sweep(
        spec,
        counts,
        network,
        method=args.method,
        seed=args.seed,
        batch=args.batch,
        blocks_per_worker=args.blocks_per_worker,
        gain=args.gain,
        memory=available_memory(),
        progress=lambda c: tqdm(c, desc="sweep", disable=not sys.stderr.isatty(), leave=False),
    )
    k, peak = sweep.knee, sweep.peak
    if args.out is not None:  # written before anything is shown: a closed stdout loses nothing
        files = {"sweep.json": json.dumps(sweep.to_dict(), indent=1).encode()}
        files["sweep.png"] = sweep_png(sweep)
        write_files(args.out, files)
    echo(f"{spec.name}, {args.method}, batch {args.batch} ({network.describe()}):")
    echo(sweep_table(sweep))
    why = (
        f"still {args.gain:g}x faster per doubling at the largest count swept"
        if k == counts[-1]
        else f"no doubling beyond it makes the step {args.gain:g}x faster"
    )
    workers = f"{k} worker{'s' if k != 1 else ''}"
    echo(f"book {workers}: {why}; the fastest predicted step is at {peak}")
    if args.out is not None:
        echo(f"wrote sweep.json, sweep.png to {args.out}")
    return 0


def _advice(spec, network, machines: int, machine_file, **given):
    """`advise_for_machines` with the memory of the --machine description (if given)."""
    from netpart.planning.cluster import advise_for_machines

    memory = 0.0
    if machine_file is not None:
        from netpart.cost.sheet import read_sheet

        memory = read_sheet(machine_file).memory_bytes
    return advise_for_machines(spec, machines, network, memory_per_machine=memory, **given)


def plan_cluster(spec, args: argparse.Namespace, network) -> int:
    """`plan --machines M`: every layout predicted, the fastest recommended."""
    import json

    from netpart.files import write_files
    from netpart.planning.pictures import cluster_png
    from netpart.planning.report import cluster_markdown, cluster_table

    _check_out(args.out, "cluster.json")
    advice = _advice(
        spec,
        network,
        args.machines,
        args.machine,
        batch=args.batch,
        n_push=args.n_push,
        n_fetch=args.n_fetch,
        examples=args.examples,
        blocks_per_worker=args.blocks_per_worker,
    )
    files = {}
    if args.out is not None:  # written before anything is shown: a closed stdout loses nothing
        files = {
            "cluster.json": json.dumps(advice.to_dict(), indent=1).encode(),
            "cluster.png": cluster_png(advice),
            "report.md": cluster_markdown(advice).encode(),
        }
        write_files(args.out, files)
    echo(f"{spec.name} on {args.machines} machines, batch {args.batch} ({advice.prediction}):")
    echo(cluster_table(advice))
    echo(f"recommended: {advice.why}")
    if files:
        echo(f"wrote {', '.join(files)} to {args.out}")
    return 0


def train_layout(args: argparse.Namespace) -> None:
    """`train --machines M`: set --workers, --replicas, --ps-shards and --mode to the fastest
    parameter-server layout `plan --machines M` predicts for the same machine (--profile,
    --machine, or the built-in model), and say which and why."""
    from netpart.cost.sheet import load_machine
    from netpart.models import load_spec
    from netpart.planning.cluster import trainable
    from netpart.train.config import TrainConfig

    chosen = {
        "--workers": args.workers,
        "--replicas": args.replicas,
        "--ps-shards": args.shards,
        "--mode": args.mode,
        "--resume": args.resume,
        "--plan": args.plan,
    }
    if clash := [name for name, value in chosen.items() if value is not None]:
        raise PlanError(f"--machines chooses the layout: drop {', '.join(clash)} (or --machines)")
    if args.model is None:
        raise PlanError("--machines needs --model (the model whose layouts it weighs)")
    spec, defaults = load_spec(args.model, input=args.input), TrainConfig()
    network = load_machine(args.profile, machine=args.machine)
    advice = _advice(
        spec,
        network,
        args.machines,
        args.machine,
        batch=args.batch or defaults.data.batch,
        n_push=args.n_push or defaults.optimiser.n_push,
        n_fetch=args.n_fetch or defaults.optimiser.n_fetch,
    )
    choice = trainable(advice)
    lay = choice.layout
    args.workers, args.replicas, args.shards, args.mode = (
        lay.workers,
        lay.replicas,
        lay.shards,
        lay.mode,
    )
    faster = ""
    if advice.best is not choice:
        best = advice.best
        faster = (
            f"; {best.layout} is predicted faster ({best.samples_per_s:,.0f} samples/s): "
            "that is DistributedDataParallel's, not netpart's"
        )
    flags = f"--workers {lay.workers} --replicas {lay.replicas} --ps-shards {lay.shards}"
    rate = f"{choice.samples_per_s:,.0f} samples/s predicted ({advice.prediction})"
    echo(f"--machines {args.machines}: training {lay} ({flags} --mode {lay.mode}), {rate}{faster}")
