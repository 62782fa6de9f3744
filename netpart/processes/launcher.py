"""The one process launcher: start a job's processes on this machine, watch them, stop them.

`netpart run`, `check` and `train` start their processes here; under torchrun, torchrun
starts them and each process only joins the group (`join_group`). A process runs
`MODULE.main()` with ARGS as its command line and the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE) and `NETPART_STORE`, the path of a file store in a private temporary
directory: the rendezvous opens no network listener. Output goes to one log file per rank.
The processes are forked by one preloaded interpreter (`netpart.processes.zygote`): torch is
imported once per job, not once per process (`fork=False`: one `python -m MODULE` each).

One signal scheme for every job. SIGINT, SIGTERM or SIGHUP (a terminal closed) to the launcher
is passed on once to every
process as SIGTERM — a training process stops at its next step boundary, a `run`/`check`
worker simply ends — and `stopping` is set; a second signal sets `forced` (the caller stops
waiting). When the launcher leaves the `Processes` block, live processes get what is left of
`grace` seconds from the first signal (none if nothing asked them to stop, or after a second
signal), then are killed, and every one is reaped. Processes also die with the launcher, even
by SIGKILL (PR_SET_PDEATHSIG). Exit codes of a job: 0 done, 1 a failure while running, 2 bad
input (found before anything starts), 130 stopped by a signal.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from netpart.processes.groups import form_default_group
from netpart.processes.liveness import is_stopped, joined, mark_joined, private_tmpdir
from netpart.processes.memory import keep_freed_memory
from netpart.processes.zygote import Forked, Preloaded, die_with_parent

__all__ = [
    "STORE_ENV",
    "Processes",
    "gloo_io_threads",
    "join_group",
    "keep_freed_memory",
    "last_error",
    "mark_started",
    "reaped",
    "torchrun_attempt",
    "wait_all",
    "yield_io_threads",
]

log = logging.getLogger(__name__)

STORE_ENV = "NETPART_STORE"


class Processes:
    """`world` processes of `python -m module *args`, rank k logging to `logs[k]` with `env`
    added to its variables (a context manager: every process is reaped when the block ends,
    whatever ends it)."""

    def __init__(
        self,
        module: str,
        args: list[str],
        logs: list[Path],
        *,
        grace: float = 0.0,
        new_session: bool = False,
        fork: bool = True,
        preloaded: Preloaded | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.module, self.args, self.logs, self.env = module, args, logs, dict(env or {})
        self.world, self.grace, self.new_session = len(logs), grace, new_session
        self.fork, self.preloaded = fork, preloaded
        self.procs: list[subprocess.Popen | Forked] = []
        self.stopping = threading.Event()
        self.signalled = threading.Event()  # a signal came (the user's stop, not the caller's)
        self.forced = threading.Event()  # a second signal: stop waiting, kill what is left
        self.stopped_at: float | None = None
        self._previous: dict[int, object] = {}
        self._tmp: str | None = None
        self._zygote: Preloaded | None = None
        self._started = False

    def __enter__(self) -> Processes:
        self._tmp = private_tmpdir("store")
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            for log_path in self.logs:
                log_path.parent.mkdir(parents=True, exist_ok=True)
            if self.fork:
                zygote = self.preloaded or Preloaded.kept(self.module, self.new_session)
                self._zygote = zygote
                ranks = [(self.rank_env(k), self.logs[k]) for k in range(self.world)]
                self.procs = list(self._zygote.fork(self.args, ranks, self.stopping.is_set))
            else:
                self.procs = [self._spawn(rank) for rank in range(self.world)]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if self.stopping.is_set():  # a signal came while they started
            self.stopping.clear()
            self.stop()
        return self

    def unjoined(self) -> list[int]:
        """The ranks holding up the job's start: those that have not reached the rendezvous,
        or, if every one has, those that have not come out of it."""
        if self._tmp is None or self._started:
            return []
        store = Path(self._tmp) / "store"
        for stage in ("arrived", "joined"):
            missing = [k for k in range(self.world) if not Path(f"{store}.{stage}{k}").exists()]
            if missing:
                return missing
        return []

    def started(self) -> bool:
        """Whether every process has joined the job's process group (until then a process
        that dies leaves the others waiting in the rendezvous: the job cannot start)."""
        if not self._started and self._tmp is not None:
            self._started = joined(str(Path(self._tmp) / "store"), self.world) == self.world
        return self._started

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables that make a process rank `rank` of this job."""
        return {
            **self.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            STORE_ENV: str(Path(self._tmp) / "store"),
        }

    def _spawn(self, rank: int) -> subprocess.Popen:
        with open(self.logs[rank], "ab") as fh:
            return subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                env={**os.environ, **self.rank_env(rank)},
                stdout=fh,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
                start_new_session=self.new_session,  # a terminal's Ctrl-C comes through us
            )

    def _on_signal(self, signum, frame) -> None:
        first = not self.signalled.is_set()
        self.signalled.set()
        if not first and self.stopping.is_set():
            log.warning("signal %d again: killing every process", signum)
            self.forced.set()
            return
        log.warning("signal %d: stopping every process (again to kill them)", signum)
        self.stop()

    def stop(self) -> None:
        """Ask every live process to stop (SIGTERM), once."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.stopped_at = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def codes(self) -> list[int | None]:
        """Each process's exit code, None while it runs (every process is polled)."""
        return [p.poll() for p in self.procs]

    def running(self) -> int:
        return self.codes().count(None)

    def zygote_gone(self) -> bool:
        """Whether the preloaded interpreter that forked the processes died (they die with it)."""
        return self._zygote is not None and self._zygote.gone

    def stopped_ranks(self) -> list[int]:
        """The ranks whose process is stopped (SIGSTOP): alive, holding its connections,
        answering nothing."""
        return [k for k, p in enumerate(self.procs) if p.poll() is None and is_stopped(p.pid)]

    def kill(self, ranks: list[int]) -> None:
        """Kill (SIGKILL) and reap the given ranks that still run."""
        for k in ranks:
            if self.procs[k].poll() is None:
                self.procs[k].kill()
                self.procs[k].wait()

    def last_error(self, rank: int) -> str:
        return last_error(self.logs[rank])

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic()
        if self.stopped_at is not None and not self.forced.is_set():
            deadline = self.stopped_at + self.grace
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        if self._zygote is not None:  # it ends once every child has been reaped (a kept
            self._zygote.release()  # one waits for the next job)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


@contextlib.contextmanager
def reaped(procs: list[subprocess.Popen]):
    """A block after which none of `procs` (the list may grow inside it) still runs: those
    left, however the block ends, are killed and reaped."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    """Wait for every process; RuntimeError naming `what` when one fails (or TimeoutExpired
    when one outlives `timeout`). Use inside `reaped`."""
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            raise RuntimeError(f"{what} failed (exit code {p.returncode})")


def last_error(path: Path) -> str:
    """The last line of a log that mentions an error (else its last line)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1].strip()


def join_group(
    timeout: float, store_timeout: float | None = None, *, started: bool = True
) -> tuple[int, int]:
    """Join the job's default gloo process group; returns (rank, world).

    Started by `Processes`: through its file store. Started by torchrun (or any env://
    launcher): through MASTER_ADDR/MASTER_PORT. `timeout` bounds every collective and
    point-to-point operation of the group; `store_timeout` the rendezvous (default: timeout).
    The group is checked before use and formed again if a connection that is not the job's
    took a peer's place (`netpart.processes.groups`).
    `started=False`: the process has more start-up exchanges to make and calls `mark_started`
    after them (until then its launcher holds it to the start-up deadline).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    keep_freed_memory()
    pg_timeout = datetime.timedelta(seconds=timeout)
    path = os.environ.get(STORE_ENV)
    if path:
        mark_joined(path, rank, "arrived")
        store = dist.FileStore(path, world)
        store.set_timeout(datetime.timedelta(seconds=store_timeout or timeout))
    else:
        # Under torchrun after a restart, its agent's store still holds the first attempt's
        # addresses under the keys init_process_group uses (pytorch/pytorch#135712).
        prefix = f"netpart/attempt{torchrun_attempt()}/"
        store = dist.PrefixStore(prefix, _env_store(world, pg_timeout))
    form_default_group(store, rank, world, pg_timeout)
    if path and started:
        mark_joined(path, rank)
    yield_io_threads()
    return rank, world


def mark_started() -> None:
    """Tell the local launcher that this process has finished starting (see `join_group`)."""
    path = os.environ.get(STORE_ENV)
    if path:
        mark_joined(path, int(os.environ["RANK"]))


def torchrun_attempt() -> int:
    """Which restart of its job torchrun started this process as (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def _env_store(world: int, timeout: datetime.timedelta) -> dist.Store:
    """A client of the store at MASTER_ADDR:MASTER_PORT (torchrun's agent, or rank 0's when
    the agent does not share its own)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ["RANK"])
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )


def yield_io_threads(policy: int = os.SCHED_BATCH) -> int:
    """Make gloo's I/O threads (`gloo_tcp_loop`) SCHED_BATCH: they still get a fair share of
    the CPU, but never preempt the thread that woke them. Call it again after creating
    process groups (each has its own I/O thread); returns how many threads it changed.
    `policy` os.SCHED_OTHER puts them back as gloo starts them, as a plain torch job runs.

    Why: gloo's I/O thread handles a pair's events only if `trylock` on the pair succeeds,
    and epoll is level-triggered. When it preempts a compute thread that holds that lock
    (posting a send), it spins on epoll_wait until the scheduler tick while the lock holder
    waits for the CPU: on a machine with as many busy processes as cores, an exchange's tail
    becomes a scheduler tick long (docs/runtime.md).
    """
    changed = 0
    for tid in gloo_io_threads():
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                changed += 1
        except (OSError, AttributeError):  # the thread ended, or not Linux
            continue
    return changed


def gloo_io_threads() -> list[int]:
    """The thread ids of this process's gloo I/O threads (`gloo_tcp_loop`, one a group's
    device; each wakes 100 times a second while its group is held); [] where /proc has no
    threads to read."""
    found = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as fh:
                    if fh.read().strip() == "gloo_tcp_loop":
                        found.append(int(tid))
            except OSError:  # the thread ended
                continue
    return found
