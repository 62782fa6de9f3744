"""Issue 19 item 8: a local job's listeners (the rendezvous store, gloo's pairs) bind loopback."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import finish

pytestmark = pytest.mark.timeout(120)

LOOPBACK = {(4, "0100007F"), (6, "00000000000000000000000001000000")}


def listening() -> set[tuple[int, str, int]]:
    """(family, hex address, port) of every TCP socket in LISTEN state (/proc/net/tcp{,6})."""
    out = set()
    for path, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":
                address, port = fields[1].split(":")
                out.add((family, address, int(port, 16)))
    return out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "tiny-local", "--workers", "2", "--steps", "300"],
        ["check", "--model", "tiny-local", "--workers", "2"],
    ],
)
def test_a_local_job_listens_on_loopback_only(tmp_path, argv):
    before = listening()
    extra = ["--out", str(tmp_path / "run")] if argv[0] == "train" else []
    cmd = [sys.executable, "-m", "netpart", *argv, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    opened = set()
    try:
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() - start < 90:
            opened |= listening() - before
            time.sleep(0.02)
    finally:
        _, err = finish([proc], timeout=30)[0]
    assert proc.returncode == 0, err.decode()[-2000:]
    assert opened, "saw no listener: the job ended before it could be looked at"
    exposed = sorted(s for s in opened if (s[0], s[1]) not in LOOPBACK)
    assert not exposed, f"listeners beyond loopback: {exposed}"
