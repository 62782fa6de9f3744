"""The benchmarks' one harness: how a benchmark parses its flags, times its cases side by side
and writes its results.

Every benchmark answers one question a user asks (benchmarks/README.md lists them). On a host
whose speed moves within minutes, a speed figure is a ratio of cases timed side by side in one
run: `alternate` runs the cases in rounds (warm-up first, the order reversed every other
round), records each run's seconds with the speed probe sampled beside it, and reports each
case's median and its ratio to the first case. `write_results` stores a benchmark's figures as
JSON with what the run ran on (commit, date, host load, torch) so that docs/measurements.md can
cite the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "RESULTS",
    "Case",
    "Rounds",
    "alternate",
    "host",
    "parser",
    "role_out",
    "write_results",
]

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


@dataclass
class Case:
    """One case's runs: wall seconds, CPU seconds of this process, the probe beside each."""

    name: str
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu)

    def to_dict(self) -> dict:
        return {
            "median_s": self.median_s,
            "median_cpu_s": self.median_cpu_s,
            "runs_s": self.seconds,
            "cpu_s": self.cpu,
            "probe_s": self.probe,
        }


@dataclass
class Rounds:
    """What `alternate` measured: every case, in the order given (the first is the base)."""

    cases: list[Case]

    def __getitem__(self, name: str) -> Case:
        return next(c for c in self.cases if c.name == name)

    def ratio(self, name: str) -> float:
        """A case's median over the first case's."""
        return self[name].median_s / self.cases[0].median_s

    def round_ratios(self, a: str, b: str) -> list[float]:
        """Case `a`'s seconds over case `b`'s, round by round (their median is the figure
        least moved by the host's slow spells, which a round's two runs share)."""
        return [x / y for x, y in zip(self[a].seconds, self[b].seconds, strict=True)]

    def to_dict(self) -> dict:
        base = self.cases[0].name
        return {
            "base": base,
            "cases": {c.name: c.to_dict() | {"ratio": self.ratio(c.name)} for c in self.cases},
        }


def alternate(
    cases: dict[str, Callable[[], object]],
    *,
    rounds: int = 5,
    warmup: int = 1,
    probe: bool = True,
) -> Rounds:
    """Time each of `cases` (name -> a call) `rounds` times, alternating: round r runs them in
    the given order when r is even, reversed when odd, after `warmup` untimed calls each. A
    call that returns a float has measured itself (a step time read off the run): that float
    is its seconds; otherwise its wall time is. With `probe`, netpart's speed probe samples
    the machine beside every run (torch is imported)."""
    for run in cases.values():
        for _ in range(warmup):
            run()
    measured = {name: Case(name) for name in cases}
    order = list(cases)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            seconds, cpu, speed = _timed(cases[name], probe=probe)
            measured[name].seconds.append(seconds)
            measured[name].cpu.append(cpu)
            measured[name].probe.append(speed)
    return Rounds([measured[n] for n in order])


def _timed(run: Callable[[], object], *, probe: bool) -> tuple[float, float, float]:
    """(seconds, CPU seconds of this process, probe median or 0) of one call."""
    with contextlib.ExitStack() as stack:
        sampler = None
        if probe:
            from netpart.calibrate.speed import SpeedProbe

            sampler = stack.enter_context(SpeedProbe())
        t0, c0 = time.perf_counter(), time.process_time()
        value = run()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if isinstance(value, float):
        seconds = value
    return seconds, cpu, sampler.median() if sampler is not None else 0.0


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
