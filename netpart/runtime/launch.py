"""Launching model workers as processes: local spawn, or the environment torchrun sets.

`run_step` validates the plan and its schedule, writes a job directory (spec, plan files,
batch), hosts the rendezvous store, and starts N processes of `python -m
netpart.runtime.launch --job DIR`, each with the variables torchrun would set (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every process is joined or killed on every exit path:
when one fails, the others get `timeout` seconds to notice through the process group and exit,
then they are killed. Results come back as `result_<rank>.pt` files (loaded weights_only).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.errors import RuntimeFailure
from netpart.files import plan_files, write_files
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.runtime.result import StepResult, assemble, load_worker_result
from netpart.runtime.schedule import plan_schedule
from netpart.runtime.transport import PEER_LOST

__all__ = ["WorkerFailure", "run_step", "spawn"]

log = logging.getLogger(__name__)

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_PR_SET_PDEATHSIG = 1


class WorkerFailure(RuntimeFailure):
    """A worker process failed; the message carries its last error line."""


def run_step(
    spec: ModelSpec,
    plan: PartitionPlan,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    timeout: float = 60.0,
    threads: int = 1,
    steps: int = 1,
) -> StepResult:
    """One forward/backward step of `spec` partitioned by `plan`, in `plan.workers` processes.

    `threads` is torch's intra-op thread count per worker. With `steps` > 1 each worker repeats
    the step (gradients zeroed, a barrier before each) and reports per-step wall times; the
    result describes the last step.
    """
    plan_schedule(spec, plan)  # refuse a foreign or corrupted plan before any process starts
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    with tempfile.TemporaryDirectory(prefix="netpart-job-") as tmp:
        job = Path(tmp)
        files = plan_files(plan)
        files["spec.json"] = spec.to_json().encode()
        files["config.json"] = json.dumps(
            {
                "seed": seed,
                "dtype": dtype_name,
                "timeout": timeout,
                "threads": threads,
                "steps": steps,
            }
        ).encode()
        write_files(job, files)
        torch.save({"inputs": inputs, "targets": targets}, job / "batch.pt")
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            plan.workers + 1,
            True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        _spawn_and_wait(job, plan.workers, store.port, timeout)
        results = [load_worker_result(job / f"result_{r}.pt") for r in range(plan.workers)]
    return assemble(spec, results, inputs.shape[0], dtype)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the kernel kills this worker if the launcher dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    module_args: list[str], rank: int, world: int, port: int, log: Path, new_session: bool = False
) -> subprocess.Popen:
    """Start `python -m MODULE ARGS` as rank `rank` of `world` with the variables torchrun sets
    (rendezvous on 127.0.0.1:`port`), output appended to `log`; it dies with this process."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", *module_args],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            start_new_session=new_session,
        )


@contextlib.contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into SystemExit while workers run, so the cleanup below still happens."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _spawn_and_wait(job: Path, workers: int, port: int, timeout: float) -> None:
    with _sigterm_as_exit():
        _spawn_and_wait_inner(job, workers, port, timeout)


def _spawn_and_wait_inner(job: Path, workers: int, port: int, timeout: float) -> None:
    procs: list[subprocess.Popen] = []
    logs = [job / f"worker_{r}.log" for r in range(workers)]
    try:
        for rank in range(workers):
            args = ["netpart.runtime.worker_main", "--job", str(job)]
            procs.append(spawn(args, rank, workers, port, logs[rank]))
        first_failure: float | None = None
        while [p.poll() for p in procs].count(None):  # poll every process, every round
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = time.monotonic()  # the others now have `timeout` to notice
            if first_failure is not None and time.monotonic() - first_failure > timeout:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        # Causes first: survivors' errors only name the peer they lost.
        failed.sort(key=lambda rc: (rc[1] != -9 and PEER_LOST in _last_error(logs[rc[0]]), rc[0]))
        raise WorkerFailure(
            "; ".join(
                f"worker {r} "
                + (
                    "was killed after the timeout"
                    if code == -9
                    else f"exited with code {code}: {_last_error(logs[r])}"
                )
                for r, code in failed
            )
        )


def _last_error(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1].strip()
