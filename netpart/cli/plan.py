"""`netpart models | plan | inspect | graph`: the planning commands (no processes, no torch)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from netpart.cli.common import (
    add_model_args,
    add_profile_arg,
    capacities,
    check_writable,
    echo,
    positive_int,
    seed_int,
)
from netpart.cli.machines import machines_options, plan_cluster, sweep
from netpart.cost.sheet import load_machine
from netpart.errors import PlanError
from netpart.processes.memory import available_memory

QUIET_S = 5.0  # off a terminal, planning says what it is doing after this long without a word
# Units a worker owns of the widest layer below which, on more than a few workers, every
# slice is mostly its fixed costs
SMALLEST_SLICE, FEW_WORKERS = 64, 8

__all__ = ["register"]

EPILOG_PLAN = """\
outputs in --out DIR:
  plan.json        schema_version, model + fingerprint, method, options, metrics
                   (edge_cut, volume, lower_bound, max_layer_imbalance, predicted_step_s),
                   per-layer and per-worker figures
  node_map.npy     block -> worker (int64), loads back with netpart.partition.plans.load_plan
  report.md        the report, with the figures below
  partition_map.png, load.png, halo_traffic.png (+ compare.png with --compare: log
                   scales, an undefined ratio (traffic over a bound of 0) marked)
  plan.json "auto" the candidates auto weighed and the rule it chose by (default method)

examples:
  netpart plan --model image-80m --workers 16 --out out/img16
  netpart plan --model speech --workers 8 --compare --out out/speech8
  netpart plan --model my-net.toml --workers 4 --net bandwidth=10Gbit,latency=20us
"""


def register(sub) -> None:
    """Add `models`, `plan`, `inspect` and `graph` to the subcommands."""
    sub.add_parser(
        "models",
        help="list the zoo models with their parameter counts",
        description="List the models built into netpart (the zoo): name, parameters, input "
        "and layers. Any of them is a --model; so is a .toml or .json spec of your own.",
    ).set_defaults(func=cmd_models)
    _plan_parser(sub)
    m = sub.add_parser(
        "import",
        help="read your own nn.Module into a spec you can read, edit and plan",
        description="Trace MODULE (FILE.py:NAME or package.module:NAME: an nn.Module class "
        "built with no arguments, or a function returning a module) with one example input of "
        "shape --input, and write it as netpart's spec (TOML): the layers netpart knows, in "
        "order. A module netpart cannot represent yet is named in one line (exit 2).",
    )
    m.add_argument("module", metavar="MODULE", help="FILE.py:NAME or package.module:NAME")
    m.add_argument("--input", required=True, help="one example's shape: CxHxW (3x32x32) or N (440)")
    m.add_argument("--out", type=Path, default=None, help="the .toml to write (default: stdout)")
    m.set_defaults(func=cmd_import, torch=True)
    i = sub.add_parser(
        "inspect",
        help="check a plan directory against its model and print its summary",
        description="Load PLAN (a directory or its plan.json), check that it was made for MODEL "
        "(default: the zoo model the plan names) and print its summary and layer table.",
    )
    i.add_argument("plan", type=Path, help="plan directory written by `netpart plan --out`")
    add_model_args(
        i, required=False, default=" the plan must match (default: the zoo model it names)"
    )
    i.set_defaults(func=cmd_inspect)

    g = sub.add_parser(
        "graph",
        help="export a model's unit graph (METIS .graph or GraphML)",
        description="Build the unit graph of MODEL at the granularity a plan for WORKERS uses "
        "and write it as METIS .graph text (one weight per layer) or GraphML (small graphs).",
    )
    add_model_args(g, required=True)
    g.add_argument("--workers", type=positive_int, default=1, help="granularity as for N workers")
    g.add_argument(
        "--format",
        choices=["metis", "graphml"],
        default="metis",
        help="metis: METIS .graph text, one vertex weight per layer; graphml: networkx "
        "GraphML with each block's layer, FLOPs, units and box (up to 20,000 blocks)",
    )
    g.add_argument("--out", type=Path, required=True, metavar="FILE", help="file to write")
    g.set_defaults(func=cmd_graph)


def _plan_parser(sub) -> None:
    from netpart.partition.methods import METHODS

    p = sub.add_parser(
        "plan",
        help="partition a model across N workers and write plan files and a report",
        description=(
            "Partition MODEL across WORKERS model workers and report per-worker load, halo "
            "traffic, the lower bound and the predicted step time."
        ),
        epilog=EPILOG_PLAN,
    )
    add_model_args(p, required=True)
    p.add_argument(
        "--workers", type=positive_int, default=None, help="number of model workers (or --sweep)"
    )
    machines_options(p)
    p.add_argument(
        "--method",
        default="auto",
        choices=["auto", *METHODS],
        help="partitioner (default: auto, the plan with the lowest predicted step among METIS on "
        "the unit graph, METIS on the layer-aligned graph (metis-aligned) and tiles, or METIS "
        "and stripe for fully connected models; plan.json records every candidate)",
    )
    p.add_argument(
        "--batch", type=positive_int, default=32, help="batch size for step time (default 32)"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="partitioner seed (default 0)")
    _metis_options(p)
    p.add_argument(
        "--blocks-per-worker",
        type=positive_int,
        default=24,
        help="granularity: target blocks per worker in each spatial layer (default 24)",
    )
    _network_options(p)
    p.add_argument(
        "--compare", action="store_true", help="also run every method and add a comparison"
    )
    p.add_argument(
        "--ps-shards",
        type=positive_int,
        default=None,
        help="parameter-server shards to lay the parameters out over (default: workers)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for plan files, report and figures (default: print only, write nothing)",
    )
    p.add_argument("--no-figures", action="store_true", help="with --out: skip the PNG figures")
    p.set_defaults(func=cmd_plan)


def _network_options(p: argparse.ArgumentParser) -> None:
    """What the prediction assumes: --net figures and/or a calibrated --profile."""
    p.add_argument(
        "--net",
        default="",
        metavar="SPEC",
        help="network model, e.g. bandwidth=10Gbit,latency=20us,flops=50G "
        "(defaults: 1Gbit, 50us, 20G FLOP/s per worker); with --profile, the figures given "
        "replace the profile's (e.g. the cluster's links), and speed=8x makes every machine "
        "that many times as fast as the profile's",
    )
    add_profile_arg(p)


def _metis_options(p: argparse.ArgumentParser) -> None:
    """The options that tune METIS (refused with any other --method)."""
    p.add_argument(
        "--imbalance",
        type=float,
        default=None,
        help="auto, metis, metis-aligned: allowed per-layer imbalance, 0.03 = 3%% (default 0.03)",
    )
    p.add_argument(
        "--capacities",
        type=capacities,
        default=None,
        help="auto, metis, metis-aligned, tiles: relative speed of each worker for unequal "
        "machines, e.g. 1,1,2,2 (default: all equal)",
    )
    p.add_argument(
        "--bands",
        type=positive_int,
        default=None,
        help="tiles: number of row bands (default: a near-square grid)",
    )
    p.add_argument(
        "--metis-algorithm",
        choices=["recursive", "kway"],
        default=None,
        help="metis, metis-aligned: recursive bisection (metis's default; fastest, lowest "
        "volume on the unit graph) or k-way (metis-aligned's default)",
    )
    p.add_argument(
        "--objective",
        choices=["vol", "cut"],
        default=None,
        help="metis k-way objective: vol = communication volume (default), cut = edge cut; "
        "recursive bisection always cuts edges",
    )


def cmd_models(args: argparse.Namespace) -> int:
    from netpart.models import ZOO

    width = max(map(len, ZOO))
    echo(f"{'model':<{width}} {'params':>15}  {'input':<10} layers")
    for name, spec in ZOO.items():
        kinds = [layer.kind for layer in spec.layers]
        if len(kinds) > 12:  # a deep network: how many of each kind
            counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
            kinds = [f"{count} {kind}" for kind, count in counts.items()]
        echo(f"{name:<{width}} {spec.num_params:>15,}  {spec.input.shape!s:<10} {' '.join(kinds)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from netpart.processes.memory import keep_freed_memory

    keep_freed_memory()  # planning builds and drops arrays of hundreds of MB, again and again
    from netpart.compile.shards import ShardLayout
    from netpart.files import write_files
    from netpart.models import load_spec
    from netpart.partition import Granularity, build_unit_graph
    from netpart.partition.plans import plan_files
    from netpart.planning.pictures import figures
    from netpart.planning.report import report_markdown

    spec = load_spec(args.model, input=args.input)
    network = load_machine(args.profile, args.net, args.machine)
    if [args.workers, args.sweep, args.machines].count(None) != 2:
        raise PlanError(
            "give one of --workers N, --sweep COUNTS (several counts) or --machines M (how "
            "to spend M machines)"
        )
    if args.sweep is not None:
        return sweep(spec, args, network)
    if args.machines is not None:
        return plan_cluster(spec, args, network)
    options = _metis_choices(args)
    _check_out(args.out)
    granularity = Granularity.for_workers(args.workers, args.blocks_per_worker)
    common = {"seed": args.seed, "batch": args.batch, "network": network}
    plans = _make_plans(spec, args, options, {**common, "granularity": granularity})
    main_plan = plans[0]
    comparison = plans if args.compare else []
    widest = max(s.size for s in spec.shapes)
    if args.workers > FEW_WORKERS and widest / args.workers < SMALLEST_SLICE:
        print(
            f"netpart: warning: {args.workers} workers own about {widest / args.workers:.0f} "
            f"units each of {spec.name}'s widest layer ({widest:,} units), fewer than "
            f"{SMALLEST_SLICE}: each slice's fixed costs outweigh its arithmetic, which "
            "uncalibrated figures do not price; plan fewer workers, or calibrate",
            file=sys.stderr,
        )
    graph = build_unit_graph(spec, main_plan.granularity)
    shards = ShardLayout.build(
        graph, main_plan.node_map, args.workers, args.ps_shards or args.workers
    )
    files = {}
    if args.out is not None:  # written before anything is shown: a closed stdout loses nothing
        files = plan_files(main_plan)
        figs = {} if args.no_figures else figures(graph, main_plan, comparison)
        report = report_markdown(spec, main_plan, comparison, list(figs), shards)
        files["report.md"] = report.encode()
        files.update(figs)
        write_files(args.out, files)
    _show(spec, main_plan, shards, comparison)
    if files:
        echo(f"wrote {', '.join(files)} to {args.out}")
    return 0


def _check_out(out: Path | None) -> None:
    """`--out` must be new, empty, or a plan directory, and writable (checked before any
    planning)."""
    from netpart.files import foreign_entries

    if out is not None:
        check_writable(out, "--out")
    if out is not None and out.exists() and not out.is_dir():
        raise PlanError(f"--out {out}: exists and is not a directory")
    if out is not None and (found := foreign_entries(out, "plan.json", ("train.json",))):
        raise PlanError(
            f"--out {out}: not empty and not a plan directory (holds {', '.join(found)}); "
            "choose a new or empty directory"
        )


def _show(spec, main_plan, shards, comparison: list) -> None:
    """The plan on the terminal: summary, candidates, layers, shards, comparison."""
    from netpart.planning.report import (
        auto_table,
        compare_table,
        layer_table,
        shard_table,
        summary_line,
    )

    echo(summary_line(main_plan))
    if main_plan.candidates:
        echo(auto_table(main_plan))
        echo()
    echo(layer_table(main_plan, spec))
    echo()
    echo(f"parameter server: {shards.shards} shards")
    echo(shard_table(shards))
    if comparison:
        echo()
        echo(compare_table(comparison))


def _metis_choices(args: argparse.Namespace) -> dict:
    """The partitioner options given on the command line; one the method ignores is refused."""
    from netpart.partition.methods import METHOD_OPTIONS

    options = {
        k: v
        for k, v in (
            ("imbalance", args.imbalance),
            ("capacities", args.capacities),
            ("algorithm", args.metis_algorithm),
            ("objective", args.objective),
            ("bands", args.bands),
        )
        if v is not None
    }
    allowed = ("imbalance", "capacities") if args.method == "auto" else ()
    allowed = METHOD_OPTIONS.get(args.method, allowed)
    for key in options:
        if key not in allowed:
            flag = {"algorithm": "metis-algorithm"}.get(key, key)
            takes = [m for m, keys in METHOD_OPTIONS.items() if key in keys]
            takes += ["auto"] if key in ("imbalance", "capacities") else []
            raise PlanError(
                f"--{flag} does not apply to --method {args.method}; it applies to "
                f"{', '.join(takes)}"
            )
    return options


def _make_plans(spec, args: argparse.Namespace, options: dict, common: dict) -> list:
    """The plan of --method, then (with --compare) one of every other method, with a bar."""
    from tqdm import tqdm

    from netpart.partition import plan
    from netpart.partition.methods import METHODS
    from netpart.partition.planner import auto_candidates

    methods = [args.method] + ([m for m in METHODS if m != args.method] if args.compare else [])
    steps = 3 * (
        len(methods) + (len(auto_candidates(spec, args.workers)) - 1) * (args.method == "auto")
    )
    plans = []
    show = sys.stderr.isatty()
    said = [time.monotonic()]  # off a terminal: a line once planning has been quiet a while
    with tqdm(total=steps, desc="plan", disable=not show, leave=False) as bar:
        for method in methods:
            opts = options if method == args.method else {}

            def phase(name: str) -> None:
                bar.set_postfix_str(name)
                bar.update(1)
                now = time.monotonic()
                if not show and now - said[0] >= QUIET_S:
                    print(
                        f"netpart: planning {spec.name} on {args.workers} workers: {name}",
                        file=sys.stderr,
                    )
                    said[0] = now

            plans.append(
                plan(
                    spec,
                    args.workers,
                    method,
                    on_phase=phase,
                    memory=available_memory(),
                    **common,
                    **opts,
                )
            )
    return plans


def cmd_import(args: argparse.Namespace) -> int:
    from netpart.files import write_atomic
    from netpart.models.importer import import_model, load_module, parse_input, spec_toml

    shape = parse_input(args.input)  # before importing anything of the user's
    if args.out is not None:
        check_writable(args.out, "--out")
    name = args.module.rpartition(":")[2]
    spec = import_model(load_module(args.module), shape, name)
    text = spec_toml(spec)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    write_atomic(args.out, text.encode())
    echo(
        f"wrote {args.out}: {spec.name}, {len(spec.layers)} layers, {spec.num_params:,} parameters"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from netpart.models import ZOO, load_spec
    from netpart.partition.plans import load_plan
    from netpart.planning.report import layer_table, summary_line

    plan = load_plan(args.plan)
    if args.model is None and plan.model not in ZOO:
        raise PlanError(
            f"{args.plan}: plan is for {plan.model!r}, not a zoo model; pass --model FILE"
        )
    spec = load_spec(args.model or plan.model, input=args.input)
    plan.check_model(spec)
    from netpart.compile.schedule import plan_schedule

    plan_schedule(spec, plan)  # what `train --plan` checks: the two files belong together
    echo(summary_line(plan))
    echo(layer_table(plan, spec))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    import networkx as nx

    from netpart.files import write_atomic
    from netpart.models import load_spec
    from netpart.partition import Granularity, build_unit_graph

    spec = load_spec(args.model, input=args.input)
    graph = build_unit_graph(spec, Granularity.for_workers(args.workers))
    if args.format == "metis":
        data = graph.to_metis_text().encode()
    else:
        try:
            g = graph.to_networkx()
        except ValueError as exc:
            raise PlanError(f"--format graphml: {exc}; use --format metis") from None
        for _, attrs in g.nodes(data=True):
            attrs["box"] = ",".join(map(str, attrs["box"]))
        data = "\n".join(nx.generate_graphml(g)).encode()
    write_atomic(args.out, data)
    echo(
        f"wrote {args.out}: {graph.num_vertices} blocks, {graph.num_edges} edges, "
        f"{len(graph.layers)} layers"
    )
    return 0
