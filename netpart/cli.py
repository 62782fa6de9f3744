"""`netpart` command line: parse, call the library, write the results. Thin on purpose.

Errors a user can cause end in one line on stderr and exit code 2, with nothing half-written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

from netpart import __version__
from netpart.errors import NetpartError, PlanError, RuntimeFailure

log = logging.getLogger("netpart")

EPILOG_PLAN = """\
outputs in --out DIR:
  plan.json        schema_version, model + fingerprint, method, options, metrics
                   (edge_cut, volume, lower_bound, max_layer_imbalance, predicted_step_s),
                   per-layer and per-worker figures
  node_map.npy     block -> worker (int64), loads back with netpart.files.load_plan
  report.md        the report, with the figures below
  partition_map.png, load.png, halo_traffic.png (+ compare.png with --compare)

examples:
  netpart plan --model image-80m --workers 16 --out out/img16
  netpart plan --model speech --workers 8 --compare --out out/speech8
  netpart plan --model my-net.toml --workers 4 --net bandwidth=10Gbit,latency=20us
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _capacities(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers (e.g. 1,1,2), got {text!r}"
        ) from None
    if not caps or any(c <= 0 for c in caps):
        raise argparse.ArgumentTypeError(f"capacities must be positive numbers, got {text!r}")
    return caps


def _add_launch_args(parser: argparse.ArgumentParser, batch: int, stats_help: str) -> None:
    """The options `run` and `check` share: what to run, how to split it, where to report."""
    from netpart.partition.methods import METHODS

    parser.add_argument("--model", required=True, help="zoo name or .toml/.json")
    parser.add_argument(
        "--workers", required=True, type=_positive_int, help="model worker processes"
    )
    parser.add_argument("--method", default="metis", choices=list(METHODS), help="partitioner")
    parser.add_argument("--plan", type=Path, default=None, help="use this plan directory instead")
    parser.add_argument(
        "--batch", type=_positive_int, default=batch, help=f"examples per step (default {batch})"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, batch and partitioner seed")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a worker waits for a peer before giving up (default 60)",
    )
    parser.add_argument("--stats", type=Path, default=None, help=stats_help)


def _per_worker_stats(result) -> list[dict]:
    """Bytes and seconds per worker, keyed "layer:phase", for the --stats JSON files."""

    def keyed(d: dict) -> dict:
        return {f"{k[0]}:{k[1]}": v for k, v in d.items()}

    return [
        {
            "worker": w,
            "sent": keyed(result.sent[w]),
            "received": keyed(result.received[w]),
            "compute_s": keyed(result.compute_s[w]),
            "exchange_s": keyed(result.exchange_s[w]),
        }
        for w in range(len(result.sent))
    ]


def build_parser() -> argparse.ArgumentParser:
    from netpart.partition.methods import METHODS

    parser = argparse.ArgumentParser(
        prog="netpart",
        description=(
            "Partition neural networks DistBelief-style: a network is a graph of unit blocks, "
            "METIS cuts it across model workers with one balance constraint per layer."
        ),
    )
    parser.add_argument("--version", action="version", version=f"netpart {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sub.add_parser("models", help="list the zoo models with their parameter counts")

    p = sub.add_parser(
        "plan",
        help="partition a model across N workers and write plan files and a report",
        description=(
            "Partition MODEL across WORKERS model workers and report per-worker load, halo "
            "traffic, the lower bound and the predicted step time."
        ),
        epilog=EPILOG_PLAN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="zoo name (see `netpart models`) or .toml/.json")
    p.add_argument("--workers", required=True, type=_positive_int, help="number of model workers")
    p.add_argument(
        "--method",
        default="metis",
        choices=list(METHODS),
        help="partitioner (default: metis, one balance constraint per layer; tiles: brick tiles "
        "balanced per layer, pools' inputs following the pools, the least halo on image models)",
    )
    p.add_argument(
        "--batch", type=_positive_int, default=32, help="batch size for step time (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="partitioner seed (default 0)")
    p.add_argument(
        "--imbalance",
        type=float,
        default=None,
        help="metis: allowed per-layer imbalance, 0.03 = 3%% (default 0.03)",
    )
    p.add_argument(
        "--capacities",
        type=_capacities,
        default=None,
        help="metis: relative speed of each worker for unequal machines, e.g. 1,1,2,2",
    )
    p.add_argument(
        "--metis-algorithm",
        choices=["recursive", "kway"],
        default=None,
        help="metis: recursive bisection (default; fastest, lowest volume measured on the zoo) "
        "or k-way",
    )
    p.add_argument(
        "--objective",
        choices=["vol", "cut"],
        default=None,
        help="metis k-way objective: vol = communication volume (default), cut = edge cut; "
        "recursive bisection always cuts edges",
    )
    p.add_argument(
        "--blocks-per-worker",
        type=_positive_int,
        default=24,
        help="granularity: target blocks per worker in each spatial layer (default 24)",
    )
    p.add_argument(
        "--net",
        default="",
        metavar="SPEC",
        help="network model, e.g. bandwidth=10Gbit,latency=20us,flops=50G "
        "(defaults: 1Gbit, 50us, 20G FLOP/s per worker)",
    )
    p.add_argument(
        "--compare", action="store_true", help="also run every method and add a comparison"
    )
    p.add_argument(
        "--ps-shards",
        type=_positive_int,
        default=None,
        help="parameter-server shards to lay the parameters out over (default: workers)",
    )
    p.add_argument("--out", type=Path, default=None, help="directory for plan files and report")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")

    r = sub.add_parser(
        "run",
        help="time partitioned steps in N processes against the plan's prediction",
        description="Run STEPS forward/backward steps of MODEL partitioned across WORKERS "
        "processes (torch.distributed, gloo; weights are not updated) and report the measured "
        "step time (slowest worker, median after warm-up) next to the plan's predicted step "
        "time, the per-layer compute and exchange time, and the bytes moved.",
    )
    _add_launch_args(r, batch=32, stats_help="write the measurements as JSON")
    r.add_argument("--steps", type=_positive_int, default=10, help="timed steps (default 10)")
    r.add_argument("--threads", type=_positive_int, default=1, help="torch threads per worker")

    c = sub.add_parser(
        "check",
        help="run one partitioned step in N processes and compare it with the reference",
        description="Run one forward/backward step of MODEL partitioned across WORKERS processes "
        "(torch.distributed, gloo) and the same step on the single-process reference in "
        "float64; print the largest differences of loss, outputs and every parameter gradient "
        "and the bytes each layer moved against the plan. Exit 0 only when all agree.",
    )
    _add_launch_args(c, batch=4, stats_help="write bytes per layer/worker as JSON")
    c.add_argument(
        "--tolerance", type=float, default=1e-9, help="abs and rel tolerance (default 1e-9)"
    )

    i = sub.add_parser(
        "inspect",
        help="check a plan directory against its model and print its summary",
        description="Load PLAN (a directory or its plan.json), check that it was made for MODEL "
        "(default: the zoo model the plan names) and print its summary and layer table.",
    )
    i.add_argument("plan", type=Path, help="plan directory written by `netpart plan --out`")
    i.add_argument("--model", default=None, help="zoo name or .toml/.json the plan must match")

    g = sub.add_parser(
        "graph",
        help="export a model's unit graph (METIS .graph or GraphML)",
        description="Build the unit graph of MODEL at the granularity a plan for WORKERS uses "
        "and write it as METIS .graph text (one weight per layer) or GraphML (small graphs).",
    )
    g.add_argument("--model", required=True, help="zoo name or .toml/.json")
    g.add_argument("--workers", type=_positive_int, default=1, help="granularity as for N workers")
    g.add_argument("--format", choices=["metis", "graphml"], default="metis")
    g.add_argument("--out", type=Path, required=True, help="output file")
    from netpart.cli_train import add_parsers

    add_parsers(sub)
    return parser


def _cmd_models() -> int:
    from netpart.models import ZOO

    print(f"{'model':<12} {'params':>15}  {'input':<10} layers")
    for name, spec in ZOO.items():
        kinds = " ".join(layer.kind for layer in spec.layers)
        print(f"{name:<12} {spec.num_params:>15,}  {spec.input.shape!s:<10} {kinds}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from netpart.files import plan_files, write_files
    from netpart.models import load_spec
    from netpart.partition import Granularity, NetworkModel, build_unit_graph, plan
    from netpart.partition.methods import METHODS
    from netpart.partition.report import (
        compare_table,
        figures,
        layer_table,
        report_markdown,
        shard_table,
        summary_line,
    )
    from netpart.partition.shards import ShardLayout

    spec = load_spec(args.model)
    network = NetworkModel.parse(args.net) if args.net else NetworkModel()
    options = {
        k: v
        for k, v in (
            ("imbalance", args.imbalance),
            ("capacities", args.capacities),
            ("algorithm", args.metis_algorithm),
            ("objective", args.objective),
        )
        if v is not None
    }
    if options and args.method != "metis":
        flag = {"algorithm": "metis-algorithm"}.get(next(iter(options)), next(iter(options)))
        raise PlanError(f"--{flag} applies to --method metis only")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise PlanError(f"--out {args.out}: exists and is not a directory")
    granularity = Granularity.for_workers(args.workers, args.blocks_per_worker)
    common = {
        "seed": args.seed,
        "batch": args.batch,
        "network": network,
        "granularity": granularity,
    }

    methods = [args.method] + ([m for m in METHODS if m != args.method] if args.compare else [])
    plans = []
    show = sys.stderr.isatty()
    with tqdm(total=3 * len(methods), desc="plan", disable=not show, leave=False) as bar:
        for method in methods:
            opts = options if method == args.method else {}

            def phase(name: str, method: str = method) -> None:
                bar.set_postfix_str(f"{method}: {name}")
                bar.update(1)

            plans.append(plan(spec, args.workers, method, on_phase=phase, **common, **opts))
    main_plan = plans[0]
    comparison = plans if args.compare else []
    graph = build_unit_graph(spec, granularity)
    shards = ShardLayout.build(
        graph, main_plan.node_map, args.workers, args.ps_shards or args.workers
    )

    print(summary_line(main_plan))
    print(layer_table(main_plan))
    print()
    print(f"parameter server: {shards.shards} shards")
    print(shard_table(shards))
    if comparison:
        print()
        print(compare_table(comparison))

    if args.out is None:
        return 0
    files = plan_files(main_plan)
    figs: dict[str, bytes] = {}
    if not args.no_figures:
        figs = figures(graph, main_plan, comparison)
    report = report_markdown(spec, main_plan, comparison, list(figs), shards)
    files["report.md"] = report.encode()
    files.update(figs)
    write_files(args.out, files)
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


def _plan_for_run(args: argparse.Namespace):
    """The spec and plan `run` and `check` use: --plan (checked) or a fresh one."""
    from netpart.files import load_plan
    from netpart.models import load_spec

    spec = load_spec(args.model)
    if args.timeout <= 0:
        raise PlanError(f"--timeout must be positive, got {args.timeout}")
    if args.plan is None:
        return spec, None
    p = load_plan(args.plan, spec)
    if p.workers != args.workers:
        raise PlanError(
            f"{args.plan}: the plan is for {p.workers} workers, not --workers {args.workers}"
        )
    return spec, p


def _cmd_run(args: argparse.Namespace) -> int:
    import json

    import numpy as np
    import torch

    from netpart.files import write_atomic
    from netpart.partition import plan
    from netpart.runtime import run_step
    from netpart.runtime.check import make_batch

    spec, p = _plan_for_run(args)
    p = p or plan(spec, args.workers, args.method, seed=args.seed, batch=args.batch)
    x, y = make_batch(spec, args.batch, args.seed)
    warmup = min(3, args.steps - 1) if args.steps > 1 else 0
    result = run_step(
        spec,
        p,
        x.float(),
        y,
        seed=args.seed,
        dtype=torch.float32,
        timeout=args.timeout,
        threads=args.threads,
        steps=args.steps + warmup,
    )
    per_step = np.max(np.array(result.step_times), axis=0)[warmup:]
    measured = float(np.median(per_step))
    scale = args.batch / p.batch  # the plan predicts at its own batch size; both terms scale
    predicted = p.metrics.predicted_step_s * scale
    print(
        f"{spec.name} on {args.workers} worker processes ({p.method}), batch {args.batch}, "
        f"{args.threads} thread(s) each: step {measured * 1e3:.1f} ms (median of {len(per_step)}; "
        f"plan predicts {predicted * 1e3:.1f} ms with its network model)"
    )
    print(f"{'layer':<10} {'compute ms':>11} {'exchange ms':>12}  (slowest worker, last step)")
    for i in range(len(spec.layers)):
        comp = max(c.get((i, "forward"), 0) + c.get((i, "backward"), 0) for c in result.compute_s)
        exch = max(e.get((i, "forward"), 0) + e.get((i, "backward"), 0) for e in result.exchange_s)
        print(f"{spec.layer_name(i):<10} {comp * 1e3:>11.2f} {exch * 1e3:>12.2f}")
    sent = sum(v for s in result.sent for v in s.values())
    print(f"bytes moved per step: {sent:,} (plan: {2 * p.metrics.volume * args.batch * 4:,})")
    if args.stats is not None:
        stats = {
            "model": spec.name,
            "workers": args.workers,
            "method": p.method,
            "batch": args.batch,
            "threads": args.threads,
            "step_s": per_step.tolist(),
            "step_s_median": measured,
            "predicted_step_s": predicted,
            "per_worker": _per_worker_stats(result),
        }
        write_atomic(args.stats, json.dumps(stats, indent=1).encode())
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import json

    from netpart.files import write_atomic
    from netpart.partition import plan
    from netpart.runtime.check import (
        check_step,
        check_step_distributed,
        require_memory,
        under_torchrun,
    )

    spec, p = _plan_for_run(args)
    require_memory(spec, args.batch)
    p = p or plan(spec, args.workers, args.method, seed=args.seed)
    if under_torchrun():
        report = check_step_distributed(
            spec, p, args.batch, args.seed, args.tolerance, args.timeout
        )
        if report is None:  # not rank 0: rank 0 prints the verdict
            return 0
        result = None
    else:
        report, result = check_step(spec, p, args.batch, args.seed, args.tolerance, args.timeout)
    print(f"{spec.name}: {args.workers} worker processes ({p.method}) vs reference, float64")
    print(f"{'quantity':<28} {'max abs diff':>14} {'max rel diff':>14}  ok")
    for d in report.differences:
        print(f"{d.name:<28} {d.max_abs:>14.3e} {d.max_rel:>14.3e}  {'yes' if d.ok else 'NO'}")
    print(f"\n{'layer':>5} {'phase':<9} {'bytes sent':>12} {'planned':>12}")
    for layer, phase, measured, planned in report.bytes_rows:
        print(f"{layer:>5} {phase:<9} {measured:>12,} {planned:>12,}")
    if args.stats is not None and result is not None:
        stats = {
            "model": spec.name,
            "workers": args.workers,
            "batch": args.batch,
            "bytes_match_plan": report.bytes_match,
            "per_worker": _per_worker_stats(result),
            "differences": [vars(d) for d in report.differences],
        }
        write_atomic(args.stats, json.dumps(stats, indent=1).encode())
    verdict = "OK" if report.ok else "MISMATCH"
    print(
        f"\n{verdict}: {'all within' if report.ok else 'not all within'} {args.tolerance:g}; "
        f"bytes {'equal' if report.bytes_match else 'differ from'} the plan"
    )
    return 0 if report.ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from netpart.files import load_plan
    from netpart.models import ZOO, load_spec
    from netpart.partition.report import layer_table, summary_line

    plan = load_plan(args.plan)
    if args.model is None and plan.model not in ZOO:
        raise PlanError(
            f"{args.plan}: plan is for {plan.model!r}, not a zoo model; pass --model FILE"
        )
    plan.check_model(load_spec(args.model or plan.model))
    print(summary_line(plan))
    print(layer_table(plan))
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    import networkx as nx

    from netpart.files import write_atomic
    from netpart.models import load_spec
    from netpart.partition import Granularity, build_unit_graph

    spec = load_spec(args.model)
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
    print(
        f"wrote {args.out}: {graph.num_vertices} blocks, {graph.num_edges} edges, "
        f"{len(graph.layers)} layers"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "models":
            return _cmd_models()
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "graph":
            return _cmd_graph(args)
        if args.command == "inspect":
            return _cmd_inspect(args)
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "run":
            return _cmd_run(args)
        if args.command in ("train", "eval", "report", "export"):
            from netpart.cli_train import cmd_eval, cmd_export, cmd_report, cmd_train

            command = {
                "train": cmd_train,
                "eval": cmd_eval,
                "report": cmd_report,
                "export": cmd_export,
            }[args.command]
            return command(args, print)
    except NetpartError as exc:
        print(f"netpart: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeFailure as exc:
        print(f"netpart: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netpart: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - never written to again
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2
