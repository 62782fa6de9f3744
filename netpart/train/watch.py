"""The fault policy while a training job's processes run on this machine (`Watch`), and the
verdict once they have ended. `netpart.train.supervise` starts the processes and asks.

- **Start-up**: until every process has joined the job's process group the others wait in
  the rendezvous for the missing one, so a process that ends then (killed, crashed, or a
  shard's stop) ends the job at once, in one line naming it; and the job ends, naming them,
  if processes have not finished starting (joined, and learnt the placement) by
  `config.start_timeout`.
- **A worker** that fails takes only its replica down (its mates get `timeout` to notice,
  then are killed) and training goes on; once every worker has ended, the shards are told to
  stop (they write their final checkpoints) instead of waiting for peers that are gone.
- **A shard** that dies is restarted from its checkpoint with the whole job (the verdict
  returns it), up to `restarts` times; one that reports an error, or the coordinator,
  stops the job.
- **A stopped process** (SIGSTOP: alive, connected, silent) is named when it is: a process
  stopped for longer than `timeout` ends the job, and replicas lost meanwhile are blamed on
  it, not on the peer that noticed.
- **A stop asked for** (a signal to the launcher) ends the job as stopped, whatever the
  processes exited with: those still starting end by the signal itself.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from netpart.errors import WorkerFailure
from netpart.processes.launcher import Processes
from netpart.train.config import TrainConfig
from netpart.train.rundir import TrainSummary

__all__ = ["REPORTED_ERROR", "Died", "Watch", "exit_text", "resume_hint"]

log = logging.getLogger(__name__)

REPORTED_ERROR = 1  # the exit code of a process that failed and said why in its log
SETTLE = 0.3  # s a worker's death waits before it counts as its replica's loss


@dataclass(frozen=True)
class Died:
    """Shards that died and are to be restarted from their checkpoints: which (every one
    that died, in order), the first one's exit code, its last error line, and what to
    blame: the shard itself, or the preloaded interpreter that forked them all."""

    shards: tuple[int, ...]
    code: int
    why: str
    blame: str

    def exit_text(self, shard: int) -> str:
        """How `shard` ended, as the restart record says it."""
        if self.blame.startswith("the"):  # not the shard's own failure
            return f"was killed when {self.blame} died"
        return exit_text(self.code)


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
    if not any(run.glob("shard_*.pt")):
        return f"no checkpoint was written in {run} (a new job may reuse it)"
    if not all((run / f"shard_{s}.pt").exists() for s in range(config.cluster.shards)):
        return (
            f"not every shard wrote a checkpoint in {run}, so it cannot be resumed (a new job "
            f"may start over in it: the same command with --out {run})"
        )
    if config.cluster.mode == "sandblaster":
        return f"the last checkpoint's parameters are in {run} (Sandblaster cannot resume)"
    return f"the last checkpoint is in {run} (continue with --resume {run})"


class Watch:
    """What the processes of one attempt did so far, and what it means."""

    def __init__(self, config: TrainConfig, workers: int, summary: TrainSummary) -> None:
        self.config, self.workers, self.summary = config, workers, summary
        self.n_workers = config.cluster.replicas * workers
        self.failed: tuple[int, int] | None = None  # (shard, code) that failed first
        self.startup: tuple[int, int] | None = None  # (rank, code) that ended while starting
        self.unjoined: list[int] = []  # ranks still running that had not joined then
        self.late: list[int] = []  # ranks that had not joined by the start-up deadline
        self.first_poll = 0.0
        self.frozen: tuple[int, float] | None = None  # (rank, seconds) stopped too long
        self.user_stop = False
        self.lost_at: dict[int, float] = {}
        self.dead_since: dict[int, float] = {}  # worker rank -> when its exit was first seen
        self.stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped

    def name(self, rank: int) -> str:
        """Rank `rank`'s role on one machine (the ranks are in placement order)."""
        n = self.n_workers
        if rank < n:
            return f"replica {rank // self.workers} worker {rank % self.workers} (rank {rank})"
        if rank < n + self.config.cluster.shards:
            return f"shard {rank - n} (rank {rank})"
        return f"the coordinator (rank {rank})"

    def poll(self, procs: Processes) -> bool:
        """Look at every process once and act; True once waiting is over."""
        now, codes = time.monotonic(), procs.codes()
        if procs.signalled.is_set():  # the user's stop, not one this policy asked for
            self.user_stop = self.user_stop or self.failed is None
        if self._starting(procs, codes) or self._frozen(procs, now):
            return True
        n, workers = self.n_workers, self.workers
        failing = [s for s, c in enumerate(codes[n:]) if c not in (None, 0)]
        if self.failed is None and failing:
            self.failed = (failing[0], codes[n + failing[0]])
            procs.stop()
        for k in (k for k, c in enumerate(codes[:n]) if c not in (None, 0)):
            self.dead_since.setdefault(k, now)
        # A worker's death counts once a shard's exit had time to be seen too: workers die
        # of a dead shard, and exits are reported in no particular order.
        ready = {k // workers for k, t in self.dead_since.items() if now - t >= SETTLE}
        if self.failed is None:  # after a shard failed, workers die of it: not replica losses
            self._note_lost(procs, codes[:n], ready, now)
        for r, since in self.lost_at.items():  # mates of a lost worker get `timeout` to notice
            if now - since > self.config.cluster.timeout:
                procs.kill(list(range(r * workers, (r + 1) * workers)))
        if all(c is not None for c in codes[:n]) and not procs.stopping.is_set():
            procs.stop()  # every worker has ended: the shards write and stop
        if procs.stopping.is_set() and all(c is not None for c in codes[n:]):
            return True
        return procs.forced.is_set() or _stop_overdue(procs)  # leaving kills what is left

    def _starting(self, procs: Processes, codes: list) -> bool:
        """A process that ended before every one had joined, or one that has not joined by
        the start-up deadline: the job cannot start."""
        if procs.started() or self.startup is not None or self.late:
            return self.startup is not None or bool(self.late)
        now = time.monotonic()
        self.first_poll = self.first_poll or now
        ended = [(k, c) for k, c in enumerate(codes) if c is not None]
        if not ended and now - self.first_poll > self.config.start_timeout:
            self.late = procs.unjoined()
            procs.kill(list(range(len(codes))))
            return True
        if not ended:
            return False
        self.startup = min(ended, key=lambda kc: (kc[1] == REPORTED_ERROR, kc[0]))
        self.unjoined = [k for k in procs.unjoined() if codes[k] is None]
        procs.kill(list(range(len(codes))))
        return True

    def _frozen(self, procs: Processes, now: float) -> bool:
        """A process stopped (SIGSTOP) for longer than `timeout`: a worker is killed (its
        replica is lost, training goes on); for a shard or the coordinator the job cannot go
        on (True)."""
        stopped = set(procs.stopped_ranks())
        self.stopped_since = {k: self.stopped_since.get(k, now) for k in stopped}
        for k, since in list(self.stopped_since.items()):
            if now - since <= self.config.cluster.timeout:
                continue
            if k < self.n_workers:
                r = k // self.workers
                why = f"{self.name(k)} was stopped (SIGSTOP) past --timeout"
                self.summary.lost.setdefault(r, why)
                self.lost_at.setdefault(r, now)
                procs.kill([k])
                del self.stopped_since[k]
                continue
            self.frozen = (k, now - since)
            procs.kill(list(range(procs.world)))
            return True
        return False

    def _note_lost(self, procs: Processes, codes: list, ready: set[int], now: float) -> None:
        """Record every replica of `ready` newly lost by a worker that exited with an error.
        The cause named is a stopped process if there is one, else the worker that failed
        first in kind: killed, or with an exit code other than 1, before mates that exited
        1 because it was gone."""
        failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
        for r in sorted({k // self.workers for k in failed} & ready - set(self.summary.lost)):
            mine = [k for k in failed if k // self.workers == r]
            k = min(mine, key=lambda k: (codes[k] == REPORTED_ERROR, k))
            why = f"worker {k % self.workers} {exit_text(codes[k])}" + (
                f": {procs.last_error(k)}" if codes[k] == REPORTED_ERROR else ""
            )
            if self.stopped_since:
                why = f"{self.name(min(self.stopped_since))} is stopped (SIGSTOP); {why}"
            self.summary.lost[r] = why
            self.lost_at[r] = now
            log.warning("replica %d lost (%s); training goes on", r, why)

    def verdict(self, procs: Processes, run: Path, attempt: int) -> Died | None:
        """After every process ended: None (done, or stopped), the (shard, code) to restart,
        or WorkerFailure naming what failed; KeyboardInterrupt for a stop before the job
        started (nothing was trained)."""
        config = self.config
        self.user_stop = self.user_stop or (procs.signalled.is_set() and self.failed is None)
        self.summary.stopped = self.user_stop
        if self.user_stop:
            if not any(run.glob("shard_*.pt")):
                raise KeyboardInterrupt(
                    f"stopped before the first checkpoint; {run} is reused by the next job"
                )
            return None
        if self.startup is not None:
            k, code = self.startup
            why = f": {procs.last_error(k)}" if code == REPORTED_ERROR else ""
            missing = [r for r in self.unjoined if r != k]
            if missing and code == REPORTED_ERROR:  # it gave up waiting for them
                why += f" ({', '.join(self.name(r) for r in missing)} never joined)"
            raise WorkerFailure(
                f"{self.name(k)} {exit_text(code)} while the job was starting"
                f"{why}; nothing was trained in this attempt; "
                f"{resume_hint(run, config)}"
            )
        if self.late:
            who = ", ".join(self.name(k) for k in self.late) + " had not"
            if len(self.late) == len(procs.procs) > 1:
                who = f"none of the job's {len(self.late)} processes had"
            hint = resume_hint(run, config)
            raise WorkerFailure(
                f"{who} finished starting {config.start_timeout:g} s after "
                "the job started (stopped, or stuck in a start-up exchange); "
                f"nothing was trained in this attempt; {hint}"
            )
        if self.frozen is not None:
            k, seconds = self.frozen
            raise WorkerFailure(
                f"{self.name(k)} was stopped (SIGSTOP) for {seconds:.0f} s, "
                f"longer than --timeout {config.cluster.timeout:g}; "
                f"{resume_hint(run, config)}"
            )
        return self._shard_verdict(procs, run, attempt)

    def _shard_verdict(self, procs: Processes, run: Path, attempt: int) -> Died | None:
        config, n = self.config, self.n_workers
        codes = procs.codes()[n:]
        failed = self.failed
        if failed is None and any(c != 0 for c in codes):  # failed after the last poll
            failed = next((s, c) for s, c in enumerate(codes) if c != 0)
        if failed is None:  # replicas lost since the last poll
            self._note_lost(procs, procs.codes()[:n], set(range(config.cluster.replicas)), 0.0)
            return None
        s, code = failed
        is_shard = s < config.cluster.shards
        # every shard that died, the first failure first: each is named, each restarted
        others = [k for k, c in enumerate(codes[: config.cluster.shards]) if c not in (0, None)]
        dead = (s, *(k for k in others if k != s)) if is_shard else (s,)
        unsaid = "no error in its log" if len(dead) == 1 else "no error in their logs"
        why = procs.last_error(n + s) if code == REPORTED_ERROR else unsaid
        who = _shards_named(dead) if is_shard else "the coordinator"
        if procs.zygote_gone():
            who = "the job's preloaded interpreter (zygote)"
            why = "it forked the job's processes, which died with it"
        died = is_shard and code != REPORTED_ERROR
        has_checkpoint = all((run / f"shard_{k}.pt").exists() for k in dead)
        cluster = config.cluster
        if died and cluster.mode != "sandblaster" and has_checkpoint and attempt < cluster.restarts:
            if procs.signalled.is_set():  # the user's stop came as it died: stop, not restart
                log.warning("%s %s as the job was stopped: not restarting it", who, exit_text(code))
                self.summary.stopped = True
                return None
            return Died(dead, code, why, who)
        if died and config.cluster.mode == "sandblaster":
            why += " (Sandblaster does not restart shards)"
        elif died and not has_checkpoint:
            why += " (no checkpoint to restart it from yet)"
        elif died:
            why += (
                f" (all {config.cluster.restarts} restarts used)"
                if config.cluster.restarts
                else " (--restarts 0)"
            )
        ended = "died" if procs.zygote_gone() else exit_text(code)
        raise WorkerFailure(f"{who} {ended}: {why}; {resume_hint(run, config)}")


def _shards_named(shards: tuple[int, ...]) -> str:
    """'shard 1', 'shards 0 and 2', 'shards 0, 1 and 2'."""
    if len(shards) == 1:
        return f"shard {shards[0]}"
    *most, last = (str(s) for s in sorted(shards))
    return f"shards {', '.join(most)} and {last}"


def _stop_overdue(procs: Processes) -> bool:
    """Asked to stop more than the grace ago and still running: the rest is killed."""
    return procs.stopped_at is not None and time.monotonic() - procs.stopped_at > procs.grace
