"""What the command modules share: argument types, output, and the options of `run`/`check`.

Every command is `cmd(args) -> exit code`, registered with `set_defaults(func=cmd)`; output
goes through `echo` (stdout), errors are raised and turned into one line by `netpart.cli.main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from netpart.errors import PlanError
from netpart.train.config import MAX_SEED, MAX_TIMEOUT, MIN_TIMEOUT

__all__ = [
    "add_force_arg",
    "add_launch_args",
    "add_profile_arg",
    "byte_size",
    "capacities",
    "check_writable",
    "echo",
    "per_worker_stats",
    "plan_for_run",
    "positive_int",
    "seed_int",
    "timeout_s",
]


def echo(text: str = "") -> None:
    """One line of the command's output on stdout."""
    sys.stdout.write(f"{text}\n")


def check_writable(path: Path, flag: str) -> None:
    """PlanError (one line) before any work if `path` (a directory or file to be written)
    cannot be created where it is asked for: a read-only file system, no permission, a name
    the file system refuses, or a name that is not valid text (reports are written in it)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"{flag} {path!s}: not a valid UTF-8 path; choose another") from None
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only(probe) else "permission denied"
        raise PlanError(f"{flag} {path}: cannot write there ({why}); choose another place")
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        return
    if any(len(part.encode()) > name_max for part in path.parts):
        raise PlanError(f"{flag} {path}: a name in it is too long for the file system")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def seed_int(text: str) -> int:
    """A seed: an integer from 0 to MAX_SEED (they key 64-bit random streams)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"give an integer from 0 to {MAX_SEED}, got {value}")
    return value


def timeout_s(text: str) -> float:
    """A timeout in seconds: a number from MIN_TIMEOUT (0.1 s) to MAX_TIMEOUT (a week)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not MIN_TIMEOUT <= value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"give {MIN_TIMEOUT:g} s to a week ({MAX_TIMEOUT:g} s), got {text}"
        )
    return value


def byte_size(text: str) -> float:
    """A size in bytes with its unit ('16MB', '4 MiB'), above 0 (`netpart.cost.units`)."""
    from netpart.cost.units import quantity

    try:
        value = quantity(text, "bytes")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 16MB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def capacities(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers (e.g. 1,1,2), got {text!r}"
        ) from None
    if not caps or any(c <= 0 for c in caps):
        raise argparse.ArgumentTypeError(f"capacities must be positive numbers, got {text!r}")
    return caps


def add_force_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help="start even with more than 8 processes a core on this machine (default: refused)",
    )


MODEL_HELP = (
    "zoo name (see `netpart models`), a .toml/.json spec, or your nn.Module as FILE.py:NAME "
    "or package.module:NAME (a class built with no arguments, or a function returning a "
    "module; give --input)"
)


def add_model_args(parser: argparse.ArgumentParser, *, required: bool, default: str = "") -> None:
    """--model and --input: the network, as a zoo name, a spec file or a user's module."""
    when = " (required)" if required else default
    parser.add_argument("--model", required=required, default=None, help=MODEL_HELP + when)
    parser.add_argument(
        "--input",
        default=None,
        metavar="SHAPE",
        help="with a module --model: one example's shape, CxHxW (3x32x32) or N features (440)",
    )


def add_launch_args(parser: argparse.ArgumentParser, batch: int, stats_help: str) -> None:
    """The options `run` and `check` share: what to run, how to split it, where to report."""
    from netpart.partition.methods import METHODS

    add_model_args(parser, required=True)
    parser.add_argument(
        "--workers", required=True, type=positive_int, help="model worker processes (required)"
    )
    parser.add_argument(
        "--method",
        default="auto",
        choices=["auto", *METHODS],
        help="partitioner (default auto: the lowest predicted step; see `netpart plan --help`)",
    )
    parser.add_argument(
        "--plan", type=Path, default=None, help="use this plan directory (default: plan afresh)"
    )
    parser.add_argument(
        "--batch", type=positive_int, default=batch, help=f"examples per step (default {batch})"
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="weights, batch and partitioner seed"
    )
    parser.add_argument(
        "--timeout",
        type=timeout_s,
        default=60.0,
        help="seconds a worker waits for a peer before giving up (default 60)",
    )
    add_force_arg(parser)
    parser.add_argument(
        "--stats", type=Path, default=None, metavar="FILE", help=stats_help + " (default: none)"
    )


def plan_for_run(args: argparse.Namespace):
    """The spec and plan `run` and `check` use: --plan (checked), or None to plan afresh."""
    from netpart.models import load_spec
    from netpart.partition.plans import load_plan
    from netpart.planning.memory import check_crowding, check_process_count
    from netpart.processes.memory import available_memory

    spec = load_spec(args.model, input=args.input)
    spec.require_batch(args.batch)
    # before any planning
    what = f"--workers {args.workers}"
    check_process_count(args.workers, what, available=available_memory())
    check_crowding(args.workers, what, cores=os.cpu_count() or 1, force=args.force)
    if args.plan is None:
        return spec, None
    p = load_plan(args.plan, spec)
    if p.workers != args.workers:
        raise PlanError(
            f"{args.plan}: the plan is for {p.workers} workers, not --workers {args.workers}"
        )
    return spec, p


def per_worker_stats(result) -> list[dict]:
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


def add_profile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="predict with this machine profile (written by `netpart calibrate`) (default: the "
        "built-in network model, see --net)",
    )
    parser.add_argument(
        "--machine",
        type=Path,
        default=None,
        metavar="FILE",
        help="predict for the machine this file describes (a machine description, .toml: "
        "experiments/machines/ has some; `netpart calibrate` writes one beside its profile) "
        "(default: none)",
    )
