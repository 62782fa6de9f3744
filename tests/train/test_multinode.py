"""Training across two emulated machines: network namespaces, a rate-limited veth, torchrun."""

import json
import os
import subprocess
import sys

import pytest

from netpart.compile.shards import ShardLayout
from netpart.models import load_spec
from netpart.partition import build_unit_graph
from netpart.partition.plans import load_plan
from netpart.testbed import netns
from tests.conftest import finish

pytestmark = pytest.mark.timeout(300)

REASON = netns.unavailable()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_two_machines_train_with_replicas_on_their_own_hosts(tmp_path):
    run, steps = tmp_path / "run", 40
    args = [
        *"-m netpart train --model tiny-local --workers 2 --replicas 2".split(),
        *"--ps-shards 2 --data digits --steps".split(),
        str(steps),
        "--out",
        str(run),
        *"--timeout 30".split(),
    ]
    with netns.two_hosts(rate="100mbit") as (a, b):
        procs = netns.torchrun_on([a, b], 29561, "netns-test", 3, args)
        outs = finish(procs, 240)
        sent = a.tx_bytes() + b.tx_bytes()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    stdout = outs[0][0] + outs[1][0]
    assert f"replica 0: step {steps}" in stdout and f"replica 1: step {steps}" in stdout
    assert "held-out digits (359 examples)" in stdout and (run / "report.md").exists()

    # The default placement keeps each replica on one machine and puts a shard on each.
    ranks = json.loads((run / "placement.json").read_text())["ranks"]
    host_of = {x["role"]: x["host"] for x in ranks}
    for r in (0, 1):
        assert host_of[f"replica {r} worker 0"] == host_of[f"replica {r} worker 1"]
    assert host_of["shard 0"] != host_of["shard 1"]

    # What crossed the link: the parameter-server payloads of the pairs on different hosts
    # (pushes one way, fetches back, every step plus the first fetch), plus a few % overhead.
    spec = load_spec("tiny-local")
    p = load_plan(run, spec)
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 2, 2)
    crossing = sum(
        sum(seg.length for seg in segs) * 4 * (steps + steps + 1)
        for r in (0, 1)
        for w in (0, 1)
        for s, segs in layout.routes(w).items()
        if host_of[f"replica {r} worker {w}"] != host_of[f"shard {s}"]
    )
    assert crossing > 0 and crossing <= sent <= 1.15 * crossing


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_switched_hosts_reach_each_other_and_leave_nothing_behind():
    """Three emulated machines on one switch: every pair connects (a refused TCP connection
    proves the packet arrived), the ports are shaped, and the namespaces go away on exit."""
    probe = "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=5)"
    with netns.switched_hosts(3, rate="50mbit") as hosts:
        names = [h.netns for h in hosts]
        for src in hosts:
            for dst in hosts:
                if src is dst:
                    continue
                argv = [sys.executable, "-c", probe, dst.address]
                out = subprocess.run(src.command(argv), capture_output=True, text=True, timeout=30)
                assert "ConnectionRefusedError" in out.stderr, (src.address, dst.address, out)
        qdisc = subprocess.run(
            ["tc", "-n", hosts[0].netns, "qdisc", "show", "dev", hosts[0].device],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in names)


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_namespaces_of_a_process_that_is_gone_are_removed_and_live_ones_kept():
    """A run killed outright (SIGKILL) leaves its namespaces; the next one removes them."""
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    stale, live = f"np{gone.pid % 100000}h0", f"np{os.getpid() % 100000}h99"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        removed = netns.remove_stale()  # with any other run's leftovers
        assert stale in removed and live not in removed
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names.split() and live in names.split()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
