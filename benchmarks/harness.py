"""The benchmarks' one harness: how a benchmark parses its flags, times its cases side by side
and writes its results.

Every benchmark answers one question a user asks. On a host whose speed moves within minutes,
a speed figure is a ratio of cases timed side by side in one run: `netpart.timing.alternate`
(the timing helper calibration uses too) runs the cases in rounds, warm-up first, the order
reversed every other round, with a probe (netpart's `SpeedProbe`) sampled beside each run where
asked. `write_results` stores a benchmark's figures as JSON with what the run ran on (commit, date,
host load, torch) so that docs/measurements.md can cite the file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["RESULTS", "host", "parser", "role_out", "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring's first line as the description, and the
    flags every benchmark takes (--out, --rounds, --quick)."""
    ap = argparse.ArgumentParser(
        prog=f"benchmarks/{name}.py", description=(doc or "").strip().splitlines()[0]
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS / f"{name}.json",
        help=f"results file (default benchmarks/results/{name}.json)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="the smallest cases, a smoke run")
    return ap


def host() -> dict:
    """What a run ran on: commit, date, load, cores, Python and torch."""
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": list(os.getloadavg()),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def write_results(path: Path, results: dict) -> None:
    """Write `results` with `host()` beside them, as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host(), **results}, indent=1) + "\n")


def role_out(bed: str, role: str, world: int, args: list[str], what: str) -> str:
    """Run `python -c role RANK *args` on machines 0..world-1 of testbed `bed` (gloo over
    each machine's own link); rank 0's last line of output. SystemExit naming `what`, the
    first rank that failed, its exit code and its stderr's tail if any rank fails."""
    from netpart.testbed.bed import read

    testbed = read(bed)
    procs = [
        subprocess.Popen(
            testbed.command(
                r,
                [sys.executable, "-c", role, str(r), *args],
                {"GLOO_SOCKET_IFNAME": testbed.hosts[r].device},
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        r, code = failed[0]
        raise SystemExit(f"{what}: rank {r} exited {code}: {outs[r][1][-600:]}")
    return outs[0][0].strip().splitlines()[-1]
