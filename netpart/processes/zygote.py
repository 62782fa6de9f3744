"""A preloaded interpreter that forks a job's processes (`python -m netpart.processes.zygote`).

Each process of a job used to be a fresh `python -m MODULE`: 1.2 s importing torch, 0.35 s
more for the sympy that autograd's first backward imports, and on a machine with fewer cores
than processes those imports queue behind each other. The zygote imports them once, early
(while the launcher validates and plans), then forks one child per rank; a child's memory is
the zygote's, copied on write.

Protocol, over pipes from the launcher that started it (never the network): the command line
names the modules to import; stdin then brings one JSON line `{"module", "args", "ranks":
[{"env", "log"}]}` (an empty line: nothing to run); stdout answers `pids P0 P1 ...` once every
child is forked, then `exit PID CODE` as each ends (CODE as `Popen.returncode`: negative for a
signal). A child sets its rank's variables, writes to its log, calls `MODULE.main()` with
`sys.argv = [MODULE, *args]` and exits with what it returns. The zygote ignores SIGINT and
SIGTERM (the launcher signals the children itself) and dies with the launcher; the children
die with the zygote (PR_SET_PDEATHSIG both). Before it imports anything, the zygote moves
into a network namespace of its own (`private_net`): the children it forks listen on a
loopback no other process of the machine can reach.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

from netpart.errors import RuntimeFailure
from netpart.files import open_append
from netpart.processes.liveness import is_stopped
from netpart.processes.private_net import enter_private_network

__all__ = ["PRELOAD", "SHARED_LOOPBACK", "Forked", "Preloaded", "die_with_parent", "main"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
SHARED_LOOPBACK = "the job shares this machine's loopback"
FORK_TIMEOUT = 300.0  # s for the zygote to import torch and fork: a slow, busy machine
# Imported besides the job's module: autograd's first backward imports sympy through it.
PRELOAD = ("torch.fx.experimental.symbolic_shapes",)
# Variables read when modules are imported (the zygote's, once): a kept zygote is used only
# while they are as it was started with.
IMPORT_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH", "CUDA")


def die_with_parent() -> None:  # pragma: no cover - runs in a child
    """Linux: the kernel kills this process when its parent dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Preloaded:
    """A started zygote that imports `module` (and `preload`: PRELOAD unless given, for a job
    that runs autograd) while the caller does other work;
    `fork` runs the job's processes from it, once. `close` reaps it (and kills it if no job
    came): use it as a context manager.

    `Preloaded.kept(module)` is one this process keeps between jobs: its `fork` may be called
    again once every child of the last job has ended, so a launcher that runs job after job
    (`netpart calibrate`'s steps, a training job's restarts) imports torch once, not once a job;
    `release` keeps it when it can serve another job, and closes it otherwise."""

    _kept: ClassVar[dict[tuple, Preloaded]] = {}

    @classmethod
    def kept(
        cls, module: str, new_session: bool = False, preload: tuple[str, ...] = PRELOAD
    ) -> Preloaded:
        """This process's kept zygote of `module`, started now if there is none that can
        serve a job: one per working directory and per value of the variables that act on
        imports (IMPORT_ENV); a child takes this process's environment as it is at the fork."""
        imports = frozenset((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_ENV))
        key = (module, new_session, preload, os.getcwd(), hash(imports))
        zygote = cls._kept.get(key)
        if zygote is not None and not zygote.reusable():
            zygote = None
        if zygote is None:
            if not cls._kept:
                atexit.register(cls.close_kept)
            for other in [k for k in cls._kept if k[:3] == key[:3]]:  # busy, dead, or stale
                cls._kept.pop(other).retire()
            zygote = cls._kept[key] = cls(module, new_session, preload)
            zygote.keep = True
        return zygote

    def retire(self) -> None:
        """No longer kept: closed now, or, while a job of its runs (in another thread), when
        that job releases it."""
        self.keep = False
        if self._ordered:
            self.drain()
        idle = all(c.pid in self.codes for c in self.children)
        if not self._ordered or idle or self.gone or self.proc.poll() is not None:
            self.close()

    @classmethod
    def kept_pids(cls) -> set[int]:
        """The process ids of this process's kept zygotes (alive, waiting for a job)."""
        return {z.proc.pid for z in cls._kept.values()}

    @classmethod
    def close_kept(cls) -> None:
        """Close every kept zygote (each ends at once: it has no job)."""
        while cls._kept:
            cls._kept.popitem()[1].close()

    def __init__(
        self, module: str, new_session: bool = False, preload: tuple[str, ...] = PRELOAD
    ) -> None:
        self.module = module
        self.keep = False  # `kept`: serves job after job
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.proc = _Spawner.popen(
            [sys.executable, "-m", "netpart.processes.zygote", module, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
            start_new_session=new_session,  # a terminal's Ctrl-C comes through the launcher
        )
        self.codes: dict[int, int] = {}
        self.children: list[Forked] = []
        self._pending = b""
        self._ordered = False
        self.gone = False  # it died (not the end of a job: it ends once its children have)

    def fork(
        self, args: list[str], ranks: list[tuple[dict[str, str], Path]], interrupted=None
    ) -> list[Forked]:
        """Fork one process per (variables, log path); their handles, in rank order.
        RuntimeFailure (one line) if the zygote is stopped or does not answer within
        FORK_TIMEOUT; KeyboardInterrupt once `interrupted()` says so (a signal came)."""
        if self._ordered and not (self.keep and self.reusable()):
            raise RuntimeError("a preloaded interpreter runs one job (a kept one, one at a time)")
        self._ordered = True
        self.codes, self.children = {}, []
        order = {
            "module": self.module,
            "args": args,
            "environ": dict(os.environ),  # as it is now, not as the zygote was started with
            "ranks": [{"env": env, "log": str(log)} for env, log in ranks],
        }
        try:
            self.proc.stdin.write((json.dumps(order) + "\n").encode())
            if self.keep:
                self.proc.stdin.flush()
            else:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died: the answer below is empty
        line, _, self._pending = self._answer(interrupted).partition(b"\n")
        first = line.split()
        if not first or first[0] != b"pids":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeFailure(
                f"the preloaded interpreter that forks the job's processes (pid {self.proc.pid}) "
                f"ended before forking them ({self._error()}); nothing was started"
            )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.children = [Forked(int(pid), self) for pid in first[1:]]
        self._read(b"")  # exit lines that came with the pids
        self._say_if_shared()
        return self.children

    def _say_if_shared(self) -> None:
        """Warn if the zygote could not give the job a network of its own (its stderr says)."""
        self.errors.seek(0)
        for line in self.errors.read().decode(errors="replace").splitlines():
            if line.startswith(SHARED_LOOPBACK):
                log.warning("%s: other local users can reach its listeners", line)

    def _answer(self, interrupted) -> bytes:
        """The zygote's first answer line (raw reads only: a buffered readline could swallow
        exit lines sent right after it), waited for in short slices: a stopped or silent
        zygote, or a signal to the launcher, ends the wait."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + FORK_TIMEOUT
        answer, self._pending = self._pending, b""  # a kept zygote's: nothing, or a part line
        while b"\n" not in answer:
            if interrupted is not None and interrupted():
                self.proc.kill()
                raise KeyboardInterrupt("stopped while the job's processes were starting")
            if is_stopped(self.proc.pid) or time.monotonic() > deadline:
                state = "is stopped (SIGSTOP)" if is_stopped(self.proc.pid) else "did not answer"
                self.proc.kill()
                raise RuntimeFailure(
                    f"the preloaded interpreter that forks the job's processes (pid "
                    f"{self.proc.pid}) {state}; nothing was started"
                )
            if not select.select([fd], [], [], 0.2)[0]:
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:  # a kept zygote's pipe is non-blocking after its first job
                continue
            if not chunk:
                break
            answer += chunk
        return answer

    def _error(self) -> str:
        self.errors.seek(0)
        lines = self.errors.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit code {self.proc.returncode}"

    def drain(self) -> bool:
        """Read the exit codes reported so far; False once the zygote has gone."""
        if self.proc.stdout.closed:
            return False
        try:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return True
        if not chunk:  # gone: its children died with it (PR_SET_PDEATHSIG)
            self.gone = self.proc.wait() != 0
            for child in self.children:
                self.codes.setdefault(child.pid, -signal.SIGKILL)
            self.proc.wait()
            self.proc.stdout.close()
            return False
        self._read(chunk)
        return True

    def _read(self, chunk: bytes) -> None:
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            _, pid, code = line.split()
            self.codes[int(pid)] = int(code)

    def reusable(self) -> bool:
        """Whether it can fork another job: alive, running, and every child reported ended."""
        if self.gone or self.proc.poll() is not None or is_stopped(self.proc.pid):
            return False
        if self._ordered:  # before its first job its pipe is blocking, and says nothing
            self.drain()
        return not self.gone and all(c.pid in self.codes for c in self.children)

    def release(self) -> None:
        """A job is done with it: a kept zygote that can serve another stays, else close."""
        if not (self.keep and self.reusable()):
            self.close()
            for key in [k for k, z in self._kept.items() if z is self]:
                del self._kept[key]

    def close(self) -> None:
        """Reap the zygote (it ends once every child has been reaped; at once if no job came)."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()  # a kept zygote waits for the next job until then
        if not self._ordered:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self._ordered:
            while self.drain():
                time.sleep(0.001)
        for f in (self.proc.stdin, self.proc.stdout, self.errors):
            with contextlib.suppress(OSError, ValueError):
                f.close()
        self.proc.wait()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Spawner:
    """Starts zygotes from a thread that lives as long as this process. The kernel sends the
    parent-death signal (`die_with_parent`) when the *thread* that forked ends, not the
    process: a zygote a job's thread started, kept for the next job, was killed as that
    thread ended. The main thread starts its own; any other hands the start to one thread
    of this process that never ends."""

    _lock = threading.Lock()
    _orders: queue.Queue | None = None

    @classmethod
    def popen(cls, argv: list[str], **kwargs) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread():
            return subprocess.Popen(argv, **kwargs)
        with cls._lock:
            if cls._orders is None:
                cls._orders = queue.Queue()
                threading.Thread(target=cls._serve, name="zygote-starter", daemon=True).start()
        started: Future[subprocess.Popen] = Future()
        cls._orders.put((argv, kwargs, started))
        return started.result()

    @classmethod
    def _serve(cls) -> None:
        while True:
            argv, kwargs, started = cls._orders.get()
            try:
                started.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # the caller's to raise
                started.set_exception(exc)


class Forked:
    """A process the zygote forked, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, zygote: Preloaded) -> None:
        self.pid, self.zygote = pid, zygote

    def poll(self) -> int | None:
        self.zygote.drain()
        return self.zygote.codes.get(self.pid)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.005)
        return self.zygote.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reported ended, so the pid is still this process's
            with contextlib.suppress(ProcessLookupError):  # reaped; its exit line is on its way
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_STOPS = {signal.SIGINT, signal.SIGTERM}


def _child(module: str, args: list[str], env: dict[str, str], log: str) -> None:
    """Become one rank of the job (`env`: its whole environment): never returns."""
    code = 1
    try:
        die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # one sent since the fork lands now
        os.environ.clear()
        os.environ.update(env)
        fd = open_append(Path(log))
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.argv = [module, *args]
        result = importlib.import_module(module).main()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the log says what happened; the launcher reads its last line
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main() -> int:
    """The zygote: import, wait for the order, fork, report exit codes until all have ended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # While single-threaded (before torch): the job's listeners on a loopback of its own.
    why = enter_private_network()
    if why:
        print(f"{SHARED_LOOPBACK} ({why})", file=sys.stderr, flush=True)
    for name in sys.argv[1:]:
        try:  # a module that fails to import fails again, with its error, in each child's log
            importlib.import_module(name)
        except Exception:
            break
    while True:  # one job after another (a kept zygote), until an empty line or EOF
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        _run(json.loads(line))


def _run(order: dict) -> None:
    """Fork one child per rank of `order`, report their pids, then each one's exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    # Blocked, not ignored, across the fork: a stop sent to a child before it has restored
    # its handlers stays pending instead of being dropped (it would then run on).
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    for rank in order["ranks"]:
        pid = os.fork()
        if pid == 0:
            env = {**order.get("environ", os.environ), **rank["env"]}
            _child(order["module"], order["args"], env, rank["log"])
        pids.append(pid)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # ignored here, as before
    out = sys.stdout
    out.write("pids " + " ".join(map(str, pids)) + "\n")
    out.flush()
    for _ in pids:
        pid, status = os.wait()
        with contextlib.suppress(OSError):  # the launcher is gone: nothing to tell
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # tearing down torch's modules is slow and helps nobody
