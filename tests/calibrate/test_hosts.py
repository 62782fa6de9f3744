"""`netpart calibrate` across hosts: one process per host, the link between them measured."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from netpart.cli import main
from netpart.cost.machine import Machine
from netpart.testbed import netns
from tests.conftest import finish

pytestmark = pytest.mark.timeout(300)

REASON = netns.unavailable()
CALIBRATE = [
    *"-m netpart calibrate --models tiny-mlp --slice-models".split(),
    "",
    *"--repeats 1 --steps 3 --check-model".split(),
    "",
]
# The link between the two hosts: a tenth of loopback's rate here, and fast enough that the
# parameter server's exchanges up to 16 MB (--ps-up-to) take under a second each: the
# exchanges' minutes grow as the link slows.
RATE_MBIT = 1000


def wire(nbytes: int) -> float:
    """Seconds `nbytes` take the shaped link one way."""
    return nbytes * 8 / (RATE_MBIT * 1e6)


@pytest.mark.alone
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_calibrate_under_torchrun_measures_the_link_between_the_hosts(tmp_path):
    out = tmp_path / "hosts.json"
    args = [*CALIBRATE, "--out", str(out), "--timeout", "60", "--ps-up-to", "16MB"]
    with netns.two_hosts(rate=f"{RATE_MBIT}mbit") as (a, b):
        procs = netns.torchrun_on([a, b], 29563, "calibrate-test", 1, args)
        outs = finish(procs, 240)
        sent = a.tx_bytes() + b.tx_bytes()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    doc = json.loads(out.read_text())
    details = doc["measurements"]
    assert details["machines"] == 2 and details["overlap"] is True
    # The link is the shaped veth, not loopback (~10 Gbit/s here): 4 MiB each way takes its
    # wire time (both directions at once, each at the full rate), and the fitted bandwidth
    # is that link's (above it by what the token bucket lets small messages gain).
    four_mib = dict(zip(details["link"]["sizes"], details["link"]["seconds"]["1"], strict=True))
    assert 0.85 < four_mib[float(1 << 22)] / wire(1 << 22) < 2.4
    model = Machine.from_dict(doc["model"])
    assert 0.6 < model.bandwidth_bps / (RATE_MBIT * 1e6) < 2, model.bandwidth_bps
    # Steps on one and on two hosts were measured, and their bytes crossed the link.
    (run,) = details["runs"]
    assert run["model"] == "tiny-mlp" and run["two"]["step_s"] > run["one"]["step_s"] > 0
    assert sent > 11 * 2 * (1 << 22)  # the link's 4 MiB messages alone, both ways
    # The parameter server's exchange was measured across the link too: a sync client's
    # 4 MB push and then its fetch take the wire's time each; a Downpour client's next push
    # crosses the link beside the answer to its last (the shard posts the receive of the next
    # request before it answers): all of a 1 MB push, the first MB of a larger one.
    ps = details["ps"]
    assert max(ps["sizes"]) == 16 * 10**6 and model.ps is not None  # --ps-up-to 16MB
    sync, downpour = (
        {b: t for b, t in zip(ps["sizes"], ps["seconds"][m]["1"], strict=True)}
        for m in ("sync", "downpour")
    )
    mb = 10**6
    assert 1.7 < sync[4 * mb] / wire(4 * mb) < 6 and 4 * sync[4 * mb] < 1.2 * sync[16 * mb]
    assert downpour[4 * mb] / wire(4 * mb) > 0.9 and downpour[4 * mb] < 0.95 * sync[4 * mb]
    assert downpour[mb] < 0.75 * sync[mb]
    assert "spread" not in ps  # one client of two shards needs three machines
    # The all-reduce, in processes of its own (`netpart.calibrate.ring`), crossed it too: a
    # ring of two moves 4 MB each way in two phases of 2 MB, the wire's time for 4 MB.
    ring = dict(zip(ps["sizes"], ps["allreduce"]["2"], strict=True))
    assert 0.9 < ring[4 * mb] / wire(4 * mb) < 3.6 and ring[mb] < ring[4 * mb]
    # and a DDP replica's step without its ring, which prices the all-reduce's replica
    assert ps["replica"]["batch"] == 32 and model.ps.replica_s("tiny-mlp") > 0


def test_a_host_that_dies_ends_calibration_with_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, procs = tmp_path / "p.json", []
    for rank in (0, 1):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NETPART_TEST_FAULT": "die:1@2",
            "PYTHONPATH": str(Path.cwd()),
            "PATH": "/usr/bin:/bin",
        }
        # --force: a busy machine (the suite's other tests) does not stop it before the death
        argv = [sys.executable, *CALIBRATE, "--out", str(out), "--timeout", "20", "--force"]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs.append(subprocess.Popen(argv, env=env, **pipes))
    outs = finish(procs, 120)
    assert [p.returncode for p in procs] == [1, 17], outs[0][1][-2000:]
    error = [line for line in outs[0][1].splitlines() if line.strip()]
    assert len(error) == 1 and "peer dead or past the timeout" in error[0], outs[0][1]
    assert not out.exists()  # nothing half-written


def test_one_process_under_torchrun_is_refused(tmp_path, monkeypatch, capsys):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--out", str(out), "--models", "tiny-mlp"]) == 2
    err = capsys.readouterr().err
    assert "at least 2" in err and err.count("\n") == 1 and not out.exists()
