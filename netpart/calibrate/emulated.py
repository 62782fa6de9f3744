"""A calibration `Runner` on emulated dedicated machines (`netpart.testbed`).

Machine i is a network namespace (`hosts[i]`, its link shaped on a switch) holding a cpu
cgroup (`groups[i]`, a share of one core): a worker and its gloo threads compete with
nothing else. Slices are timed inside machine 0 (`python -m netpart.calibrate.emulated
--slices JOB`); a link measurement or a plan's steps run one `python -m netpart.runtime.step`
process per machine, joined by a TCP store on machine 0 over the switch, and layers are split
as across real machines. Needs root (namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from netpart.calibrate.measure import step_cpu_s
from netpart.calibrate.trace import SliceTimes, measure_slices
from netpart.files import write_files
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan, load_plan, plan_files
from netpart.processes.launcher import reaped, wait_all
from netpart.runtime.check import make_batch
from netpart.runtime.result import load_worker_result
from netpart.runtime.step import StepOptions, link_job, link_result, step_job
from netpart.testbed import cgroups

__all__ = ["TIMEOUT", "WARMUP", "EmulatedRunner", "free_port", "main"]

WARMUP = 3  # untimed steps before the timed ones of every run
TIMEOUT = 600.0  # seconds any one launch may take


def free_port() -> int:
    """A TCP port no process of this network namespace listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmulatedRunner:
    """`netpart.calibrate.measure.Runner` on emulated machines (see the module docstring)."""

    hosts: list
    groups: list[Path]
    share: float  # of a core, each machine's cgroup quota
    overlap: bool = True
    probe_beside: bool = True  # the probe runs here, outside the machines
    env: dict[str, str] | None = None  # added to every process's variables (e.g. PYTHONPATH)

    @property
    def machines(self) -> int:
        return len(self.hosts)

    def _argv(self, i: int, argv: list[str], env: dict[str, str]) -> list[str]:
        # The group first: `ip netns exec` mounts the namespace's own /sys over the cgroups.
        return cgroups.command(self.groups[i], self.hosts[i].command(argv, env))

    def _env(self, **more: str) -> dict[str, str]:
        return {**(self.env or {}), "TORCH_CPP_LOG_LEVEL": "ERROR", **more}

    def slices(self, spec: ModelSpec, plans: list[PartitionPlan], batch: int) -> list:
        with tempfile.TemporaryDirectory(prefix="netpart-emulated-") as tmp:
            job = Path(tmp)
            doc = {"model": spec.to_json(), "batch": batch, "share": self.share}
            (job / "job.json").write_text(json.dumps(doc))
            for i, p in enumerate(plans):
                write_files(job / f"plan_{i}", plan_files(p))
            argv = [sys.executable, "-m", "netpart.calibrate.emulated", "--slices", tmp]
            subprocess.run(self._argv(0, argv, self._env()), check=True, timeout=TIMEOUT)
            return [
                SliceTimes.from_arrays(np.load(job / f"plan_{i}" / "slices.npz"))
                for i in range(len(plans))
            ]

    def link(self, sizes: tuple[int, ...], repeats: int, world: int) -> tuple[np.ndarray, float]:
        with tempfile.TemporaryDirectory(prefix="netpart-emulated-") as tmp:
            link_job(Path(tmp), sizes, repeats, timeout=120)
            self._launch(Path(tmp), world, f"the link among {world}")
            return link_result(Path(tmp), world)

    def step(self, spec, p: PartitionPlan, batch: int, steps: int, exchange_only=False):
        times, cpu = self.run(spec, p, batch, steps, exchange_only=exchange_only)
        return float(np.median(times)), cpu

    def run(self, spec, p: PartitionPlan, batch: int, steps: int, *, exchange_only=False):
        """(every timed step, slowest worker; the CPU seconds a step takes on the busiest
        worker, all its threads, median over the steps) of `p` on machines 0..N-1."""
        loaded = self.results(spec, p, batch, steps, exchange_only=exchange_only)
        times = np.array([result.step_times for result, _, _ in loaded])
        cpu = step_cpu_s([usage for _, _, usage in loaded], WARMUP)  # exchange-only: none
        return np.max(times, axis=0)[WARMUP:], cpu

    def results(self, spec, p: PartitionPlan, batch, steps, *, exchange_only=False, split=True):
        """Every worker's `load_worker_result` of `steps` + WARMUP steps of `p` on machines
        0..N-1 (`split`: programs hide halo behind compute, as across real machines)."""
        x, y = make_batch(spec, batch, 0)
        options = StepOptions(
            dtype="float32",
            timeout=120,
            split=split,
            steps=steps + WARMUP,
            exchange_only=exchange_only,
        )
        with tempfile.TemporaryDirectory(prefix="netpart-emulated-") as tmp:
            job = Path(tmp)
            step_job(job, spec, p, (x.float(), y), options)
            self._launch(job, p.workers, f"{spec.name} on {p.workers} machines")
            return [load_worker_result(job / f"result_{r}.pt") for r in range(p.workers)]

    def _launch(self, job: Path, n: int, what: str) -> None:
        """`python -m netpart.runtime.step --job JOB` on machines 0..n-1, to the end."""
        port, master = free_port(), self.hosts[0].address  # rank 0 hosts the store
        with reaped([]) as procs:
            for rank in range(n):
                device = self.hosts[rank].device
                env = self._env(
                    RANK=str(rank),
                    WORLD_SIZE=str(n),
                    MASTER_ADDR=master,
                    MASTER_PORT=str(port),
                    GLOO_SOCKET_IFNAME=device,
                )
                argv = [sys.executable, "-m", "netpart.runtime.step", "--job", str(job)]
                procs.append(subprocess.Popen(self._argv(rank, argv, env)))
            wait_all(procs, TIMEOUT, f"a worker of {what}")


def _slices_job(folder: Path) -> None:
    """In a machine: time every slice of the plans in folder/plan_<i>/ (one thread)."""
    torch.set_num_threads(1)
    doc = json.loads((folder / "job.json").read_text())
    spec = ModelSpec.from_json(doc["model"], str(folder / "job.json"))
    for sub in sorted(p for p in folder.iterdir() if p.name.startswith("plan_")):
        times = measure_slices(spec, load_plan(sub, spec), doc["batch"], share=doc["share"])
        np.savez(sub / "slices.npz", **times.to_arrays())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m netpart.calibrate.emulated")
    ap.add_argument("--slices", type=Path, required=True, help="a job folder of plans")
    _slices_job(ap.parse_args(argv).slices)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
