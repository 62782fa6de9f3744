"""A training job on this machine: start its processes, follow their progress, and apply the
fault policy (`netpart.train.watch`) until they have all ended. A shard that died is
restarted from its last checkpoint, with the whole job (gloo cannot take a new process into a
running group, so every process stops, the healthy shards write final checkpoints, and the
job starts again from them): `lost_updates` and `record_restart` say what the restart lost.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netpart.faults import RESTART_ENV
from netpart.files import write_atomic
from netpart.processes.launcher import Processes
from netpart.processes.memory import processes_memory
from netpart.processes.zygote import Preloaded
from netpart.ps.checkpoint import shard_meta
from netpart.train.config import TrainConfig
from netpart.train.rundir import Progress, TrainSummary
from netpart.train.watch import Died, Watch

__all__ = [
    "MEMORY_EVERY_S",
    "STOP_MARGIN",
    "Attempt",
    "JobMemory",
    "lost_updates",
    "record_restart",
    "supervise",
]

log = logging.getLogger(__name__)

STOP_MARGIN = 10.0  # s beyond --timeout a stopped job gets to write its final checkpoints
MEMORY_EVERY_S = 2.0  # s between two reads of the job's memory (each reads /proc per process)


@dataclass(frozen=True)
class Attempt:
    """One start of a job's processes: its number (0: the first), whether it resumes, the
    steps all replicas will run, who hears of the progress (`on_progress(done, stats,
    total)`), and the preloaded interpreter that forks its processes (the first only)."""

    number: int = 0
    resume: bool = False
    total: int = 0
    on_progress: Callable[[int, dict, int], None] | None = None
    preloaded: Preloaded | None = None
    loggers: Any = None  # netpart.train.loggers.MetricLoggers, fed every new metrics line


class JobMemory:
    """The memory the job's processes hold (`processes_memory`), read every MEMORY_EVERY_S
    at most, added to the progress figures as `memory_mb`."""

    def __init__(self, procs: Processes) -> None:
        self.procs, self.at, self.mb = procs, -math.inf, 0.0

    def __call__(self, done: int, stats: dict) -> tuple[int, dict]:
        now = time.monotonic()
        if now - self.at >= MEMORY_EVERY_S:
            alive = [p.pid for p in self.procs.procs if p.poll() is None]
            self.mb, self.at = processes_memory(alive) / 1e6, now
        if stats and self.mb:
            stats = {**stats, "memory_mb": self.mb}
        return done, stats


def supervise(
    run: Path, workers: int, config: TrainConfig, summary: TrainSummary, attempt: Attempt
) -> Died | None:
    """Start the job's processes and apply the fault policy until they have all ended.

    Returns the shard to restart when one died and the attempt's number < `config.cluster.restarts`;
    raises WorkerFailure when a shard or the coordinator failed otherwise, KeyboardInterrupt
    after a second signal."""
    logs = [run / "logs" / f"rank{r}.log" for r in range(config.world(workers))]
    args = ["--run", str(run), *(["--resume"] if attempt.resume else [])]
    read = Progress(run, config.cluster.replicas, attempt.loggers)
    watch = Watch(config, workers, summary)
    job = Processes(
        "netpart.train.process",
        args,
        logs,
        grace=config.cluster.timeout + STOP_MARGIN,  # shards wait `timeout` for workers, then write
        new_session=True,
        preloaded=attempt.preloaded,
        env={RESTART_ENV: str(attempt.number)},
    )
    with job as procs:
        memory = JobMemory(procs)
        while procs.running() and not watch.poll(procs):
            if attempt.on_progress is not None:
                attempt.on_progress(*memory(*read()), attempt.total)
            time.sleep(0.1)
        if watch.failed is not None:  # a failed job does not wait for the stragglers
            procs.kill(list(range(len(logs))))
        if attempt.on_progress is not None:
            attempt.on_progress(*memory(*read()), attempt.total)
    if procs.forced.is_set():
        raise KeyboardInterrupt(f"processes killed by a second signal; checkpoints are in {run}")
    return watch.verdict(procs, run, attempt.number)


def lost_updates(run: Path, shard: int, starts: dict[int, int], sync: bool, why: str) -> dict:
    """What restarting `shard` from its checkpoint loses: per replica, the steps whose pushes
    to it were applied after the checkpoint (sync: the steps it missed)."""
    meta = shard_meta(run, shard)
    had = {int(r): int(v) for r, v in meta.get("progress", {}).items()}
    clock = int(meta.get("clock", 0))
    steps = {r: max(0, s - (clock if sync else had.get(r, 0))) for r, s in starts.items()}
    return {
        "shard": shard,
        "exit": why,
        "checkpoint_updates": int(meta.get("updates", 0)),
        "lost_steps": steps,
    }


def record_restart(run: Path, restart: dict) -> None:
    """Add a restart to the run's `restarts.json` (read into the summary at the end)."""
    path = run / "restarts.json"
    done = json.loads(path.read_text()) if path.exists() else []
    steps = {str(r): n for r, n in restart["lost_steps"].items()}
    write_atomic(path, json.dumps([*done, {**restart, "lost_steps": steps}]).encode())
