"""Emulated machines: network namespaces joined by a veth pair, rate-limited with `tc tbf`.

`two_hosts()` makes two namespaces (each its own network stack: loopback, one veth end with
an address), limits each direction of the link to `rate` with a token bucket (this kernel has
no netem, so no latency is added), and on exit kills whatever still runs inside them and
deletes them (which deletes the veth pair). Needs root (CAP_NET_ADMIN); `unavailable()` says
why it cannot be used here, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.201.{}.{}"


@dataclass(frozen=True)
class Host:
    netns: str
    device: str
    address: str

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`argv` run inside this host, with `env` set there."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.netns, "env", *pairs, *argv]

    def tx_bytes(self) -> int:
        path = f"/sys/class/net/{self.device}/statistics/tx_bytes"
        return int(_run(["ip", "netns", "exec", self.netns, "cat", path]).strip())


def _run(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    probe = f"npprobe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except (OSError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"cannot create network namespaces here ({exc}); needs root and iproute2"
    _run(["ip", "netns", "del", probe])
    return None


@contextlib.contextmanager
def two_hosts(
    rate: str = "200mbit", burst: str = "256kb", subnet: int = 0
) -> Iterator[tuple[Host, Host]]:
    """Two namespaces a <-> b over a veth pair limited to `rate` each way (token bucket of
    `burst` bytes: messages smaller than it pass at full speed after an idle pause)."""
    tag = f"{os.getpid() % 100000}"
    hosts = [
        Host(f"np{tag}{side}", f"np{tag}{side}", SUBNET.format(subnet, i + 1))
        for i, side in enumerate("ab")
    ]
    made: list[str] = []
    try:
        for h in hosts:
            _run(["ip", "netns", "add", h.netns])
            made.append(h.netns)
        a, b = hosts
        _run(["ip", "link", "add", a.device, "netns", a.netns, "type", "veth",
              "peer", "name", b.device, "netns", b.netns])  # fmt: skip
        for h in hosts:
            ns = ["ip", "-n", h.netns]
            _run([*ns, "addr", "add", f"{h.address}/24", "dev", h.device])
            _run([*ns, "link", "set", h.device, "up"])
            _run([*ns, "link", "set", "lo", "up"])
            _run(["tc", "-n", h.netns, "qdisc", "add", "dev", h.device, "root", "tbf",
                  "rate", rate, "burst", burst, "latency", "100ms"])  # fmt: skip
        yield a, b
    finally:
        for name in made:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                for pid in _run(["ip", "netns", "pids", name]).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _run(["ip", "netns", "del", name])
