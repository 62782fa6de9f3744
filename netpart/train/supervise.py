"""The fault policy of a training job on this machine: watch its processes, decide what a
failure means, and say so in one true line.

DistBelief's policy, with one addition. A model worker that fails takes only its replica down
(its mates get `timeout` to notice, then are killed) and training goes on. A shard that
*dies* (killed by a signal, or an exit code other than the 1 of an error it reported) is
restarted from its last checkpoint, with the whole job, up to `config.restarts` times: gloo
cannot take a new process into a running group, so every process stops (the healthy shards
write final checkpoints), and the job starts again from them. The replicas continue from the
furthest step the shards recorded; the dead shard's updates since its checkpoint are lost,
and the summary says how many. A shard that reports an error (a checkpoint it cannot write)
or the coordinator stops the job, as does a death with no restart left. A signal stops every
process at a step boundary; a second one kills them.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netpart.errors import WorkerFailure
from netpart.faults import RESTART_ENV
from netpart.files import write_atomic
from netpart.processes.launcher import Processes
from netpart.processes.zygote import Preloaded
from netpart.ps.checkpoint import shard_meta
from netpart.train.config import TrainConfig
from netpart.train.rundir import Progress, TrainSummary

__all__ = [
    "STOP_MARGIN",
    "Attempt",
    "Died",
    "exit_text",
    "lost_updates",
    "record_restart",
    "resume_hint",
    "supervise",
]

log = logging.getLogger(__name__)

STOP_MARGIN = 10.0  # s beyond --timeout a stopped job gets to write its final checkpoints
REPORTED_ERROR = 1  # the exit code of a process that failed and said why in its log
SETTLE = 0.3  # s a worker's death waits before it counts as its replica's loss


@dataclass(frozen=True)
class Died:
    """A shard that died and is to be restarted: which, its exit code, its last error line."""

    shard: int
    code: int
    why: str


def exit_text(code: int) -> str:
    """'killed by SIGKILL' or 'exited with code 17'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def resume_hint(run: Path, config: TrainConfig) -> str:
    """Where the last checkpoint is and how to go on from it — only what is true."""
    if not (run / "shard_0.pt").exists():
        return f"no checkpoint was written in {run}"
    if config.mode == "sandblaster":
        return f"the last checkpoint's parameters are in {run} (Sandblaster cannot resume)"
    return f"the last checkpoint is in {run} (continue with --resume {run})"


def _note_lost(
    procs: Processes, codes: list, workers: int, summary: TrainSummary, ready: set[int]
) -> list[int]:
    """Record every replica of `ready` newly lost by a worker that exited with an error;
    return them. The worker named is the one that failed first in kind: one killed, or with
    an exit code other than 1, before mates that exited 1 because it was gone."""
    new = []
    failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
    for r in sorted({k // workers for k in failed} & ready - set(summary.lost)):
        mine = [k for k in failed if k // workers == r]
        k = min(mine, key=lambda k: (codes[k] == REPORTED_ERROR, k))
        summary.lost[r] = f"worker {k % workers} {exit_text(codes[k])}" + (
            f": {procs.last_error(k)}" if codes[k] == REPORTED_ERROR else ""
        )
        new.append(r)
    return new


def _stop_overdue(procs: Processes) -> bool:
    """Asked to stop more than the grace ago and still running: the rest is killed."""
    return procs.stopped_at is not None and time.monotonic() - procs.stopped_at > procs.grace


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


def supervise(
    run: Path, workers: int, config: TrainConfig, summary: TrainSummary, attempt: Attempt
) -> Died | None:
    """Start the job's processes and apply the fault policy until they have all ended.

    Returns the shard to restart when one died and the attempt's number < `config.restarts`;
    raises WorkerFailure when a shard or the coordinator failed otherwise, KeyboardInterrupt
    after a second signal."""
    logs = [run / "logs" / f"rank{r}.log" for r in range(config.world(workers))]
    args = ["--run", str(run), *(["--resume"] if attempt.resume else [])]
    read = Progress(run, config.replicas, attempt.loggers)
    watch = _Watch(config, workers, summary)
    job = Processes(
        "netpart.train.process", args, logs,
        grace=config.timeout + STOP_MARGIN,  # shards wait `timeout` for workers, then write
        new_session=True, preloaded=attempt.preloaded,
        env={RESTART_ENV: str(attempt.number)},
    )  # fmt: skip
    with job as procs:
        while procs.running() and not watch.poll(procs):
            if attempt.on_progress is not None:
                attempt.on_progress(*read(), attempt.total)
            time.sleep(0.1)
        if watch.failed is not None:  # a failed job does not wait for the stragglers
            procs.kill(list(range(len(logs))))
        if attempt.on_progress is not None:
            attempt.on_progress(*read(), attempt.total)
    if procs.forced.is_set():
        raise KeyboardInterrupt(f"processes killed by a second signal; checkpoints are in {run}")
    return watch.verdict(procs, run, attempt.number)


class _Watch:
    """What the processes of one attempt did so far, and what it means (the fault policy)."""

    def __init__(self, config: TrainConfig, workers: int, summary: TrainSummary) -> None:
        self.config, self.workers, self.summary = config, workers, summary
        self.n_workers = config.replicas * workers
        self.failed: tuple[int, int] | None = None  # (shard, code) that failed first
        self.user_stop = False
        self.lost_at: dict[int, float] = {}
        self.dead_since: dict[int, float] = {}  # worker rank -> when its exit was first seen

    def poll(self, procs: Processes) -> bool:
        """Look at every process once and act; True once waiting is over."""
        now, codes = time.monotonic(), procs.codes()
        n, workers = self.n_workers, self.workers
        failing = [s for s, c in enumerate(codes[n:]) if c not in (None, 0)]
        if self.failed is None and failing:
            self.failed = (failing[0], codes[n + failing[0]])
            self.user_stop = procs.stopping.is_set()
            procs.stop()
        for k in (k for k, c in enumerate(codes[:n]) if c not in (None, 0)):
            self.dead_since.setdefault(k, now)
        # A worker's death counts once a shard's exit had time to be seen too: workers die
        # of a dead shard, and exits are reported in no particular order.
        ready = {k // workers for k, t in self.dead_since.items() if now - t >= SETTLE}
        if self.failed is None:  # after a shard failed, workers die of it: not replica losses
            for r in _note_lost(procs, codes[:n], workers, self.summary, ready):
                log.warning("replica %d lost (%s); training goes on", r, self.summary.lost[r])
                self.lost_at[r] = now
        for r, since in self.lost_at.items():  # mates of a lost worker get `timeout` to notice
            if now - since > self.config.timeout:
                procs.kill(list(range(r * workers, (r + 1) * workers)))
        if procs.stopping.is_set() and all(c is not None for c in codes[n:]):
            return True
        return procs.forced.is_set() or _stop_overdue(procs)  # leaving kills what is left

    def verdict(self, procs: Processes, run: Path, attempt: int) -> Died | None:
        """After every process ended: None (done, or stopped), the shard to restart, or
        WorkerFailure naming what failed."""
        config, n = self.config, self.n_workers
        codes = procs.codes()[n:]
        failed = self.failed
        if failed is None and any(c != 0 for c in codes):  # failed after the last poll
            failed = next((s, c) for s, c in enumerate(codes) if c != 0)
        if failed is None:  # replicas lost since the last poll
            everyone = set(range(config.replicas))
            _note_lost(procs, procs.codes()[:n], self.workers, self.summary, everyone)
        self.summary.stopped = procs.stopping.is_set() and (failed is None or self.user_stop)
        if failed is None:
            return None
        s, code = failed
        is_shard = s < config.shards
        why = procs.last_error(n + s) if code == REPORTED_ERROR else "no error in its log"
        died = is_shard and code != REPORTED_ERROR and not self.user_stop
        restartable = config.mode != "sandblaster" and (run / f"shard_{s}.pt").exists()
        if died and restartable and attempt < config.restarts:
            return Died(s, code, why)
        who = f"shard {s}" if is_shard else "the coordinator"
        left = " (no restart left)" if is_shard and code != REPORTED_ERROR else ""
        raise WorkerFailure(f"{who} {exit_text(code)}{left}: {why}; {resume_hint(run, config)}")


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
