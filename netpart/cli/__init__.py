"""The `netpart` command: parse, call the library, write the results. Thin on purpose.

One module per command group (`plan`, `run`, `train`), each registering its subcommands with
`set_defaults(func=...)`; every command returns its exit code. Errors a user can cause end in
one line on stderr and exit code 2, with nothing half-written; a failure while running in one
line and exit code 1; a stop by SIGINT/SIGTERM in exit code 130.
"""

from __future__ import annotations

import errno
import logging
import os
import sys

from netpart import __version__
from netpart.cli import plan, run, train
from netpart.cli.parser import Parser
from netpart.errors import EXIT_FAILURE, EXIT_INPUT, EXIT_INTERRUPTED, NetpartError, RuntimeFailure

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    parser = Parser(
        prog="netpart",
        description=(
            "Partition neural networks DistBelief-style: a network is a graph of unit blocks, "
            "METIS cuts it across model workers with one balance constraint per layer."
        ),
    )
    parser.add_argument("--version", action="version", version=f"netpart {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log netpart's debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (plan, run, train):
        group.register(sub)
    parser.commands = dict(sub.choices)
    return parser


# errno values that name a path the user gave (exit 2); any other OSError is a failure (exit 1)
_PATH_ERRORS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENOENT}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:  # netpart's own debug messages, not every library's (PIL, matplotlib)
        logging.getLogger("netpart").setLevel(logging.DEBUG)
    try:
        return args.func(args)
    except NetpartError as exc:
        print(f"netpart: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except RuntimeFailure as exc:
        print(f"netpart: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt as exc:
        print(f"netpart: interrupted{f': {exc}' if str(exc) else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - never written to again
        return 0
    except OSError as exc:  # a path that cannot be written, a full disk, no process to spare
        where = f"{exc.filename}: " if exc.filename else ""
        bad_path = exc.errno in _PATH_ERRORS
        print(f"netpart: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_INPUT if bad_path else EXIT_FAILURE
