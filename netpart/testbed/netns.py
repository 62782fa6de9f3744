"""Emulated machines: network namespaces joined by veth pairs, rate-limited with `tc tbf`.

`two_hosts()` makes two namespaces (each its own network stack: loopback, one veth end with
an address), limits each direction of the link to `rate` with a token bucket (this kernel has
no netem, so no latency is added), and on exit kills whatever still runs inside them and
deletes them (which deletes the veth pair). `switched_hosts(n)` joins n namespaces through a
bridge in a namespace of its own, each port limited to `rate` both ways (a switch with one
link per machine). Both first remove the namespaces of an earlier run whose process is gone
(`remove_stale`: a run killed outright, e.g. by SIGKILL, cannot tear down its own). Needs root
(CAP_NET_ADMIN); `unavailable()` says why it cannot be used here, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.201.{}.{}"
RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")
BURST_S = 0.5e-3  # a link's token bucket holds this long of its rate, and at least
# a segmentation-offload packet (64 KiB and its headers): tbf cuts a packet larger than its
# bucket into frames in software and releases each on a timer tick of its own, which the
# receiving machine's CPU pays for frame by frame (docs/multi-node.md)
GSO_BYTES = 81920
OURS = re.compile(r"np(\d+)(?:a|b|sw|h\d+)")  # np<pid % 100000><role>


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


def torchrun_on(
    hosts: list[Host], port: int, run_id: str, nproc: int, args: list[str]
) -> list[subprocess.Popen]:
    """One torchrun node per host (c10d rendezvous hosted on the first, gloo on each host's
    veth), each running `python args`, with stdout and stderr piped."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = []
    for k, host in enumerate(hosts):
        argv = [
            torchrun,
            "--nnodes",
            str(len(hosts)),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{hosts[0].address}:{port}",
            "--rdzv-id",
            run_id,
            "--local-addr",
            host.address,
            *(["--rdzv-conf", "is_host=1"] if k == 0 else []),
            *args,
        ]
        env = {"GLOO_SOCKET_IFNAME": host.device, "PYTHONPATH": str(Path.cwd())}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs.append(subprocess.Popen(host.command(argv, env), **pipes))
    return procs


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
    rate: str = "200mbit", burst: str | None = None, subnet: int = 0
) -> Iterator[tuple[Host, Host]]:
    """Two namespaces a <-> b over a veth pair limited to `rate` each way (token bucket of
    `burst` bytes, default `burst_for(rate)`)."""
    remove_stale()
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
        _run(
            [
                "ip",
                "link",
                "add",
                a.device,
                "netns",
                a.netns,
                "type",
                "veth",
                "peer",
                "name",
                b.device,
                "netns",
                b.netns,
            ]
        )
        for h in hosts:
            _bring_up(h, rate, burst)
        yield a, b
    finally:
        teardown(made)


@contextlib.contextmanager
def switched_hosts(
    n: int,
    rate: str = "200mbit",
    burst: str | None = None,
    subnet: int = 1,
    queue: str = "100ms",
) -> Iterator[list[Host]]:
    """`n` namespaces on one bridge; each host's link is limited to `rate` in each direction
    (a token bucket on the host's end for what it sends, on the bridge's end for what it
    receives; `burst` bytes, default `burst_for(rate)`), each queueing at most `queue` of
    traffic (a switch port's buffer)."""
    remove_stale()
    tag = f"{os.getpid() % 100000}"
    switch = f"np{tag}sw"
    hosts = [Host(f"np{tag}h{i}", f"np{tag}h{i}", SUBNET.format(subnet, i + 1)) for i in range(n)]
    made: list[str] = []
    try:
        build_switch(switch, hosts, made, rate=rate, burst=burst, queue=queue)
        yield hosts
    finally:
        teardown(made)


def rate_bps(rate: str) -> float:
    """Bits per second of a rate in tc's units ("1gbit", "100mbit", "12.5mbps" = bytes/s)."""
    m = RATE.fullmatch(rate.strip().lower())
    if m is None:
        raise ValueError(f"link rate {rate!r}: give a number and a unit, e.g. 1gbit or 100mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)


def burst_for(rate: str) -> str:
    """A token bucket that lets a link carry its rate: `BURST_S` of it, at least `GSO_BYTES`.
    tbf releases at most a bucket per timer tick, and a packet larger than the bucket one
    frame at a time: with half a millisecond's bucket a 1 Gbit/s port between 0.3-core
    machines carried under half its rate, with `GSO_BYTES` nearly all of it
    (docs/measurements.md). A message within the bucket crosses an idle link at once."""
    return str(max(GSO_BYTES, round(rate_bps(rate) / 8 * BURST_S)))


def build_switch(
    switch: str, hosts: list[Host], made: list[str], *, rate: str, burst: str | None, queue: str
) -> None:
    """Namespace `switch` with a bridge, and each host's namespace on a port of it, each
    link limited to `rate` both ways (token bucket `burst`, default `burst_for(rate)`); every
    namespace made is appended to `made` (for `teardown`, also when this fails half-way)."""
    for name in [switch, *(h.netns for h in hosts)]:
        _run(["ip", "netns", "add", name])
        made.append(name)
    sw = ["ip", "-n", switch]
    _run([*sw, "link", "add", "br0", "type", "bridge"])
    _run([*sw, "link", "set", "br0", "up"])
    for i, h in enumerate(hosts):
        port = f"port{i}"
        _run(
            [
                "ip",
                "link",
                "add",
                h.device,
                "netns",
                h.netns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch,
            ]
        )
        _run([*sw, "link", "set", port, "master", "br0"])
        _run([*sw, "link", "set", port, "up"])
        _bring_up(h, rate, burst, queue)
        _shape(switch, port, rate, burst, queue)


def namespaces() -> list[str]:
    """The network namespaces that exist now."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def remove_stale() -> list[str]:
    """Delete the namespaces these helpers made for a process that no longer runs (no live
    pid has the tag in its name); returns their names."""
    live = {int(d) % 100000 for d in os.listdir("/proc") if d.isdigit()}
    names = namespaces()
    stale = [n for n in names if (m := OURS.fullmatch(n)) and int(m.group(1)) not in live]
    teardown(stale)
    return stale


def _bring_up(h: Host, rate: str, burst: str | None, queue: str = "100ms") -> None:
    """Address and raise the host's link end and loopback; shape what the host sends."""
    ns = ["ip", "-n", h.netns]
    _run([*ns, "addr", "add", f"{h.address}/24", "dev", h.device])
    _run([*ns, "link", "set", h.device, "up"])
    _run([*ns, "link", "set", "lo", "up"])
    _shape(h.netns, h.device, rate, burst, queue)


def _shape(netns: str, device: str, rate: str, burst: str | None, queue: str = "100ms") -> None:
    """A token bucket on what `device` sends: `rate`, `burst` bytes (default
    `burst_for(rate)`), `queue` of queue."""
    _run(
        [
            "tc",
            "-n",
            netns,
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst or burst_for(rate),
            "latency",
            queue,
        ]
    )


def teardown(namespaces: list[str]) -> None:
    """Kill whatever runs in each namespace, then delete it (and the links in it)."""
    for name in namespaces:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            for pid in _run(["ip", "netns", "pids", name]).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _run(["ip", "netns", "del", name])
