"""Issue 19 item 8, issue 51 item 5: a local job's listeners (gloo's pairs) bind loopback, in
a network namespace of the job's own, where no other process of the machine can reach them."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netpart.processes.private_net import network_of
from tests.conftest import finish

pytestmark = pytest.mark.timeout(120)

LOOPBACK = {(4, "0100007F"), (6, "00000000000000000000000001000000")}


def listening(pid: int | str = "self") -> set[tuple[int, str, int]]:
    """(family, hex address, port) of every TCP socket in LISTEN state in the network
    namespace of process `pid` (/proc/PID/net/tcp{,6})."""
    out = set()
    for name, family in (("tcp", 4), ("tcp6", 6)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":
                address, port = fields[1].split(":")
                out.add((family, address, int(port, 16)))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (by parent pid, from /proc)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "tiny-local", "--workers", "2", "--steps", "40"],
        ["check", "--model", "tiny-local", "--workers", "2"],
    ],
)
def test_a_local_job_listens_on_a_loopback_of_its_own(tmp_path, argv):
    ours = network_of()
    extra = ["--out", str(tmp_path / "run")] if argv[0] == "train" else []
    cmd = [sys.executable, "-m", "netpart", *argv, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    opened, networks, tried, refused = set(), set(), set(), 0
    try:
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() - start < 90:
            read = set()  # a namespace's sockets are read once a poll, through any of its pids
            for pid in descendants(proc.pid):
                if (net := network_of(pid)) and net != ours and net not in read:
                    read.add(net)
                    opened |= listening(pid)
            networks |= read
            if new := opened - tried:  # each listener once, a stranger's attempt from outside
                for _, _, port in new - listening():
                    with pytest.raises(ConnectionRefusedError), socket.socket() as s:
                        s.connect(("127.0.0.1", port))
                    refused += 1
                tried |= new
            time.sleep(0.05)
    finally:
        _, err = finish([proc], timeout=30)[0]
    assert proc.returncode == 0, err.decode()[-2000:]
    assert len(networks) == 1, f"the job's processes should share one namespace: {networks}"
    assert opened and refused, "saw no listener: the job ended before it could be looked at"
    exposed = sorted(s for s in opened if (s[0], s[1]) not in LOOPBACK)
    assert not exposed, f"listeners beyond loopback: {exposed}"
