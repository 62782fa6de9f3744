"""A named testbed: made, used by a job with one worker process on each machine (its own
network namespace and cpu cgroup), and removed with nothing left behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netpart.cli import main
from netpart.testbed import netns
from netpart.testbed.bed import STATE, TestbedError, down, read, unavailable, up

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=str(REASON)), pytest.mark.timeout(240)]


def _worker_of(group: Path) -> int | None:
    """The pid of a `netpart check` worker (torchrun's child) inside `group`, if any."""
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"check" in cmdline and b"\0RANK=" in b"\0" + environ:
            return int(pid)
    return None


def test_a_job_runs_one_worker_on_each_machine_and_down_leaves_nothing(capsys):
    name = f"t{os.getpid() % 100000}"
    bed = up(name, 2, cpu=1.0, rate="1gbit")
    try:
        with pytest.raises(TestbedError, match="exists"):
            up(name, 2, cpu=1.0, rate="1gbit")
        assert read(name) == bed
        argv = [
            sys.executable,
            *"-m netpart check --testbed".split(),
            name,
            *"--model tiny-local --workers 2".split(),
        ]
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: dict[int, int] = {}
        while job.poll() is None and len(seen) < 2:
            for i, g in enumerate(bed.groups):
                pid = _worker_of(Path(g))
                if pid is not None and i not in seen:
                    ns = subprocess.run(
                        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
                    ).stdout.strip()
                    if ns:  # identified once the worker has started inside it
                        assert ns == bed.hosts[i].netns
                        seen[i] = pid
            time.sleep(0.02)
        out, err = job.communicate(timeout=180)
        assert job.returncode == 0, err[-2000:]
        assert "OK: all within" in out
        assert sorted(seen) == [0, 1] and seen[0] != seen[1]
        # a job of another size is refused in one line before anything starts
        train = [
            *"train --testbed".split(),
            name,
            *"--model tiny-mlp --workers 1 --replicas 1 --ps-shards 2".split(),
            *"--out /nonexistent/never".split(),
        ]
        assert main(train) == 2 and main(["check", *train[1:5], "--workers", "3"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and all("2 machines and this job takes 3 processes" in e for e in err)
    finally:
        removed = down(name)
    assert bed.switch in removed and not (STATE / f"{name}.json").exists()
    assert not set(netns.namespaces()) & {bed.switch, *(h.netns for h in bed.hosts)}
    assert not any(Path(g).exists() for g in bed.groups)
    assert main(["testbed", "down", name]) == 0 and "none" in capsys.readouterr().out


def test_a_job_on_a_testbed_that_is_not_up_is_one_line(capsys):
    argv = ["check", "--testbed", "nosuchbed", "--model", "tiny-local", "--workers", "2"]
    assert main(argv) == 2
    assert "no testbed 'nosuchbed'" in capsys.readouterr().err


def test_up_leaves_a_namespace_it_did_not_make_and_what_runs_in_it():
    """Issue 80, item 8: a foreign namespace named like a testbed's part made `up` fail, and
    its clean-up deleted that namespace and SIGKILLed the process inside."""
    from netpart.testbed.bed import SUBNETS, list_testbeds

    used = {tb.subnet for tb in list_testbeds()}
    first = next(k for k in SUBNETS if k not in used)
    foreign = f"tb{first}sw"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    inside = subprocess.Popen(["ip", "netns", "exec", foreign, "sleep", "60"])
    name = f"f{os.getpid() % 100000}"
    try:
        bed = up(name, 2, cpu=0.5, rate="1gbit")
        try:
            assert bed.subnet != first and foreign not in bed.namespaces
        finally:
            down(name)
        assert foreign in netns.namespaces() and inside.poll() is None  # untouched
    finally:
        inside.kill()
        inside.wait()
        subprocess.run(["ip", "netns", "del", foreign], check=False)
