"""`netpart testbed up|down|list`: an emulated cluster on this machine (root), and
`--testbed NAME` for `train` and `check`: the command run with one process per machine of it,
through torchrun as across real machines."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from netpart.cli.common import echo, positive_int

__all__ = ["add_testbed_arg", "on_testbed", "register", "without_exit_barrier_race"]

PORT = 29500  # the rendezvous on machine 0: the namespace is the testbed's own
GRACE_S = 30.0  # after one machine's process fails, the others get this long to end
# torchrun's agents meet at an exit barrier on machine 0's store; the store's agent may leave
# it before another has read that all arrived, which then logs this with a traceback though
# the job has ended as it did (torch.distributed.elastic.agent.server.api)
EXIT_BARRIER = "Error waiting on exit barrier"
# Warnings torch logs on a testbed's job that ends as it should: a machine's address has no
# name in its namespace (c10d's socket), and the rendezvous's heartbeat to an agent that
# has already left at the end (dynamic_rendezvous). Kept out of the console; the job's own
# lines and any other warning pass.
BENIGN = (
    EXIT_BARRIER,
    "hostname of the client socket cannot be retrieved",
    "has failed to send a keep-alive heartbeat to the rendezvous",
)
LOG_PREFIX = re.compile(r"[EWI]\d{4} [\d:.]+ \d+ \S+:\d+\] ")  # a torch log record's lines


def register(sub) -> None:
    p = sub.add_parser(
        "testbed",
        help="an emulated cluster on this machine: network namespaces on a shaped switch and "
        "a cpu cgroup per machine (root)",
        description="Make, list or remove emulated machines: each a network namespace on one "
        "switch whose ports are rate-limited (tc tbf) and a cpu cgroup held to a share of one "
        "core. `netpart train|check --testbed NAME ...` runs the job with one process per "
        "machine (torchrun, as across real machines). Needs root.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    u = verbs.add_parser("up", help="make testbed NAME")
    u.add_argument("name", help="its name (lower-case letters, digits, '-')")
    u.add_argument("--machines", type=positive_int, required=True, help="how many machines")
    u.add_argument(
        "--cpu", type=float, default=0.45, help="each machine's share of one core (default 0.45)"
    )
    u.add_argument(
        "--link",
        default="1gbit",
        help="each machine's link, each way, in tc's units (default 1gbit)",
    )
    u.set_defaults(func=cmd_up)
    d = verbs.add_parser("down", help="remove testbed NAME (and whatever runs in it)")
    d.add_argument("name")
    d.set_defaults(func=cmd_down)
    ls = verbs.add_parser("list", help="the testbeds that are up")
    ls.set_defaults(func=cmd_list)


def add_testbed_arg(parser: argparse.ArgumentParser, processes=None) -> None:
    """--testbed NAME; `processes(args)`: how many processes the job takes (None: it cannot
    say before it starts), checked against the testbed's machines before anything starts."""
    parser.add_argument(
        "--testbed",
        default=None,
        metavar="NAME",
        help="run on testbed NAME (`netpart testbed up`), one process per machine (default: "
        "on this machine)",
    )
    parser.set_defaults(processes=processes)


def cmd_up(args: argparse.Namespace) -> int:
    from netpart.testbed.bed import up

    bed = up(args.name, args.machines, cpu=args.cpu, rate=args.link)
    echo(
        f"testbed {bed.name}: {bed.machines} machines at {bed.cpu:g} core, {bed.rate} links "
        f"({', '.join(h.address for h in bed.hosts)})"
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from netpart.testbed.bed import down

    removed = down(args.name)
    echo(f"testbed {args.name}: " + (f"removed {len(removed)} parts" if removed else "none"))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from netpart.testbed.bed import health, list_testbeds

    beds = list_testbeds()
    for bed in beds:
        echo(f"{bed.name}: {bed.machines} machines at {bed.cpu:g} core, {bed.rate}; {health(bed)}")
    if not beds:
        echo("no testbed is up")
    return 0


def on_testbed(name: str, argv: list[str], processes: int | None = None) -> int:
    """Run `netpart argv` (without --testbed) on every machine of testbed `name` under
    torchrun, one process a machine (static rendezvous on machine 0); the worst exit code.
    A job of `processes` processes needs as many machines (PlanError at once). One job at a
    time holds the testbed; whatever is left in its machines afterwards is killed."""
    from netpart.errors import PlanError
    from netpart.testbed import cgroups
    from netpart.testbed.bed import STATE, read

    bed = read(name)
    if processes is not None and processes != bed.machines:
        raise PlanError(
            f"--testbed {name}: it has {bed.machines} machines and this job takes {processes} "
            f"processes, one a machine; make one of {processes} (`netpart testbed up NAME "
            f"--machines {processes}`) or change the job"
        )
    with open(STATE / f"{name}.json") as record:
        try:
            fcntl.flock(record, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PlanError(f"testbed {name} runs another job now; wait for it") from None
        procs: list[subprocess.Popen] = []
        relays: list[threading.Thread] = []
        try:
            for i, host in enumerate(bed.hosts):
                env = {"GLOO_SOCKET_IFNAME": host.device, "TORCH_CPP_LOG_LEVEL": "ERROR"}
                procs.append(
                    subprocess.Popen(
                        bed.command(i, _torchrun(bed, i, argv), env),
                        stderr=subprocess.PIPE,
                        text=True,
                        errors="replace",
                    )
                )
            # each machine's stderr (its agent's and its process's) passes on line by line
            relays += [
                threading.Thread(target=_relay, args=(p.stderr, sys.stderr), daemon=True)
                for p in procs
            ]
            for relay in relays:
                relay.start()
            return _wait(procs)
        finally:
            cgroups.kill_inside([Path(g) for g in bed.groups])
            for relay in relays:  # every machine's pipe closes with what ran there
                relay.join(GRACE_S)


def _torchrun(bed, rank: int, argv: list[str]) -> list[str]:
    """The torchrun command of machine `rank` of `bed`: one process, rendezvous on machine 0."""
    return [
        str(Path(sys.executable).with_name("torchrun")),
        *("--nnodes", str(bed.machines), "--nproc-per-node", "1", "--node-rank", str(rank)),
        *("--master-addr", bed.hosts[0].address, "--master-port", str(PORT)),
        *("--local-addr", bed.hosts[rank].address),
        *("-m", "netpart", *argv),
    ]


def without_exit_barrier_race(lines: Iterable[str]) -> Iterable[str]:
    """`lines` less torch's records of what ends well (`BENIGN`: its exit barrier's race, a
    socket's unnamed host, a last heartbeat): each record's first line and the lines after
    it with the same log prefix."""
    dropping = None
    for line in lines:
        if dropping is not None and line.startswith(dropping):
            continue
        dropping = None
        head = LOG_PREFIX.match(line)
        if head and any(text in line for text in BENIGN):
            dropping = head.group(0)
            continue
        if any(text in line for text in BENIGN[1:]):  # a warning without torch's prefix
            continue
        yield line


def _relay(source: TextIO, sink: TextIO) -> None:
    for line in without_exit_barrier_race(source):
        sink.write(line)
        sink.flush()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Every machine's exit code, worst first; once one fails the rest get GRACE_S."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.1)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=GRACE_S))
        except subprocess.TimeoutExpired:  # the caller kills what is left
            codes.append(1)
    return max(codes, key=abs)
