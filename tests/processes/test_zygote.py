"""The preloaded interpreter forks a job's processes: exit codes, logs, signals, and no child
outlives it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from netpart.processes.zygote import SHARED_LOOPBACK, Preloaded

pytestmark = pytest.mark.timeout(120)
# The job below runs no autograd: its zygotes import it alone, not torch (PRELOAD).

JOB = """
import os, sys, time
def main():
    act = os.environ["ACT"]
    if act == "raise":
        raise ValueError("boom")
    if act == "sleep":
        time.sleep(60)
    print("rank", os.environ["RANK"], sys.argv[1:], flush=True)
    return 3 if act == "exit3" else 0
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def job_module(tmp_path, monkeypatch):
    (tmp_path / "zjob.py").write_text(JOB)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return tmp_path


def test_forked_processes_report_their_exit_codes_and_log_their_output(job_module):
    acts = ["ok", "exit3", "raise"]
    logs = [job_module / f"rank{k}.log" for k in range(3)]
    with Preloaded("zjob", preload=()) as zygote:
        procs = zygote.fork(
            ["a", "b"], [({"ACT": a, "RANK": str(k)}, logs[k]) for k, a in enumerate(acts)]
        )
        assert [p.wait() for p in procs] == [0, 3, 1]
    assert logs[0].read_text().strip() == "rank 0 ['a', 'b']"
    assert "ValueError: boom" in logs[2].read_text()


def test_a_job_without_a_network_of_its_own_is_told_so(job_module, caplog):
    """Where the kernel refuses the zygote a private network namespace, the job runs on the
    machine's loopback, and the launcher says so (the zygote writes why to its stderr)."""
    with Preloaded("zjob", preload=()) as zygote:
        zygote.errors.write(f"{SHARED_LOOPBACK} (unshare: Operation not permitted)\n".encode())
        (proc,) = zygote.fork([], [({"ACT": "ok", "RANK": "0"}, job_module / "r.log")])
        assert proc.wait() == 0
    assert "unshare: Operation not permitted): other local users can reach" in caplog.text


def test_signals_reach_a_forked_process_and_none_outlives_the_interpreter(job_module):
    logs = [job_module / f"rank{k}.log" for k in range(2)]
    with Preloaded("zjob", preload=()) as zygote:
        procs = zygote.fork([], [({"ACT": "sleep", "RANK": str(k)}, logs[k]) for k in range(2)])
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait() == -signal.SIGTERM
        assert procs[1].poll() is None
        zygote.proc.kill()  # the interpreter dies: its children die with it
        deadline = time.monotonic() + 10
        while _alive(procs[1].pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(procs[1].pid)
        assert procs[1].wait() == -signal.SIGKILL


def test_a_kept_zygote_runs_job_after_job_and_is_replaced_once_it_cannot(job_module):
    """`Preloaded.kept`: one torch import for every step job of a launcher; a zygote that
    died (or whose job left a child running) is not handed out again."""
    log = job_module / "kept.log"
    zygote = Preloaded.kept("zjob", preload=())
    try:
        for act, code in (("ok", 0), ("exit3", 3), ("raise", 1)):
            assert (
                Preloaded.kept("zjob", preload=()) is zygote
            )  # the same interpreter, job after job
            (proc,) = zygote.fork([act], [({"ACT": act, "RANK": "0"}, log)])
            assert proc.wait() == code
            zygote.release()
        assert log.read_text().count("rank 0") == 2 and zygote.proc.pid in Preloaded.kept_pids()
        (proc,) = zygote.fork([], [({"ACT": "sleep", "RANK": "0"}, log)])
        assert not zygote.reusable()  # its job still runs: no second job beside it
        with pytest.raises(RuntimeError, match="one at a time"):
            zygote.fork([], [({"ACT": "ok", "RANK": "0"}, log)])
        zygote.proc.kill()  # it dies, and its child with it
        assert proc.wait() == -signal.SIGKILL
        zygote.release()
        assert zygote.proc.pid not in Preloaded.kept_pids()
        again = Preloaded.kept("zjob", preload=())
        assert again is not zygote and again.proc.pid != zygote.proc.pid
    finally:
        Preloaded.close_kept()
    assert not _alive(zygote.proc.pid) and not Preloaded.kept_pids()


def test_a_kept_zygote_busy_with_a_job_is_not_handed_out_nor_closed_under_it(job_module):
    """Two jobs of one module at once (threads of one launcher): the second gets a zygote of
    its own; the first's job runs on, and its zygote closes once that job releases it."""
    log = job_module / "busy.log"
    busy = Preloaded.kept("zjob", preload=())
    try:
        (sleeper,) = busy.fork([], [({"ACT": "sleep", "RANK": "0"}, log)])
        other = Preloaded.kept("zjob", preload=())
        assert other is not busy and sleeper.poll() is None  # not killed under its job
        (proc,) = other.fork([], [({"ACT": "ok", "RANK": "1"}, log)])
        assert proc.wait() == 0
        other.release()
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL
        busy.release()  # no longer kept: closed now
        assert busy.proc.poll() is not None and Preloaded.kept("zjob", preload=()) is other
    finally:
        Preloaded.close_kept()


def test_a_kept_zygote_started_by_a_thread_outlives_the_thread(job_module):
    """The kernel's parent-death signal follows the thread that forked: a zygote a job's
    thread started (a training job run in a thread, its restart) was killed when that thread
    ended, and the next job found it dead. Kept zygotes are started by a thread that lives as
    long as the process."""
    log = job_module / "threaded.log"
    Preloaded.close_kept()
    made: list[Preloaded] = []
    starter = threading.Thread(target=lambda: made.append(Preloaded.kept("zjob", preload=())))
    starter.start()
    starter.join()
    (zygote,) = made
    try:
        (proc,) = zygote.fork(["ok"], [({"ACT": "ok", "RANK": "0"}, log)])
        assert proc.wait() == 0  # it waited for its import, alive after the thread ended
        zygote.release()
        time.sleep(0.2)  # a parent-death signal would have come at once
        assert zygote.reusable() and Preloaded.kept("zjob", preload=()) is zygote
    finally:
        Preloaded.close_kept()
