"""The `netpart` command: what did the user ask for? Parse, call the library, write the
results. Thin on purpose.

One module per command group (`plan`, `run`, `train`), each registering its subcommands with
`set_defaults(func=...)`; every command returns its exit code. Errors a user can cause end in
one line on stderr and exit code 2, with nothing half-written; a failure while running in one
line and exit code 1; a stop by SIGINT/SIGTERM in exit code 130.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted_while_loading(signum, frame) -> None:  # pragma: no cover - timing
    sys.stderr.write("netpart: interrupted\n")
    os._exit(130)


# Ctrl-C while the command's modules load (before `main` can catch it): one line, exit 130.
signal.signal(signal.SIGINT, _interrupted_while_loading)

import errno  # noqa: E402
import logging  # noqa: E402

from netpart import __version__  # noqa: E402
from netpart.cli import plan, run, testbed, train  # noqa: E402
from netpart.cli.parser import Parser  # noqa: E402
from netpart.errors import (  # noqa: E402
    EXIT_FAILURE,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    NetpartError,
    RuntimeFailure,
)

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
    for group in (plan, run, train, testbed):
        group.register(sub)
    parser.commands = dict(sub.choices)
    return parser


# errno values that name a path the user gave (exit 2); any other OSError is a failure (exit 1)
_PATH_ERRORS = {
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOENT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}


def main(argv: list[str] | None = None) -> int:
    for name in ("stdout", "stderr"):  # started with it closed (`>&-`): write nowhere
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - the process's own
    parser = build_parser()
    args = parser.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:  # netpart's own debug messages, not every library's (PIL, matplotlib)
        logging.getLogger("netpart").setLevel(logging.DEBUG)
    if threading.current_thread() is threading.main_thread():  # loaded: Ctrl-C is caught below
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if getattr(args, "torch", False):
            _load_torch()
        if getattr(args, "testbed", None):  # the same command, once on every machine of it
            count = args.processes(args) if getattr(args, "processes", None) else None
            rest = _without_testbed(argv or sys.argv[1:])
            return testbed.on_testbed(args.testbed, rest, processes=count)
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
    except Exception as exc:
        if not _caused_by_interrupt(exc):  # a bug: its traceback is what a report needs
            raise
        print("netpart: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _load_torch() -> None:
    """Import torch with SIGINT, SIGTERM and SIGHUP held: its import runs Python callbacks
    from C++, and a KeyboardInterrupt raised in one aborts the process (std::terminate,
    exit -6, a Ctrl-C about half a second after `netpart train` started). Held, a signal
    lands once the import is done, as a KeyboardInterrupt caught below."""
    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _without_testbed(argv: list[str]) -> list[str]:
    """`argv` less its --testbed NAME (or --testbed=NAME)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--testbed":
            skip = True
        elif not a.startswith("--testbed="):
            out.append(a)
    return out


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Ctrl-C while a module loads can surface wrapped (Python turns an exception raised
    in a class body's `__set_name__` into a RuntimeError caused by it)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
