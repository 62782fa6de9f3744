"""The emulated-CPU helper: a cpu cgroup per machine, a process inside it, nothing left after."""

import os
import subprocess
import sys
import time

import pytest

from netpart.testbed import cgroups

pytestmark = pytest.mark.skipif(
    cgroups.unavailable() is not None, reason=str(cgroups.unavailable())
)


def test_a_command_runs_inside_its_group_and_the_groups_go_with_the_context():
    with cgroups.cpu_shares(2, 0.45) as groups:
        period = int((groups[0] / "cpu.cfs_period_us").read_text())
        quota = int((groups[0] / "cpu.cfs_quota_us").read_text())
        assert quota >= cgroups.MIN_QUOTA_US and quota / period == pytest.approx(0.45, abs=0.01)
        argv = [sys.executable, "-c", "print(open('/proc/self/cgroup').read())"]
        out = subprocess.run(
            cgroups.command(groups[1], argv), capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert f"cpu:/{groups[1].name}" in out.replace("cpu,cpuacct", "cpu")
        sleeper = subprocess.Popen(cgroups.command(groups[0], ["sleep", "60"]))
        procs = groups[0] / "cgroup.procs"
        for _ in range(200):  # the shell joins the group after Popen returns
            if str(sleeper.pid) in procs.read_text().split():
                break
            time.sleep(0.05)
    assert sleeper.wait(timeout=10) != 0  # killed on the way out
    assert not any(g.exists() for g in groups)
    with pytest.raises(ValueError, match="share"), cgroups.cpu_shares(1, 1.5):
        pass


def test_groups_of_a_process_that_is_gone_are_removed_and_live_ones_kept():
    """A run killed outright (SIGKILL) leaves its groups; the next `cpu_shares` removes them."""
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    stale, live = cgroups.CPU / f"netpart-{gone.pid}-0", cgroups.CPU / "netpart-1-0"  # pid 1 runs
    stale.mkdir()
    live.mkdir()
    try:
        removed = cgroups.remove_stale()  # with any other run's leftovers
        assert stale in removed and live not in removed
        assert not stale.exists() and live.exists()
    finally:
        for g in (stale, live):
            if g.exists():
                g.rmdir()


def test_whole_cores_pin_each_group_to_a_core_of_its_own():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    with cgroups.whole_cores(2) as groups:
        assert [(g / "cpuset.cpus").read_text().strip() for g in groups] == ["0", "1"]
        argv = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        out = subprocess.run(
            cgroups.command(groups[1], argv), capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert out.strip() == "[1]"
    assert not any(g.exists() for g in groups)
    with pytest.raises(ValueError, match="whole cores"), cgroups.whole_cores(99):
        pass
