"""A network of one's own for a job that runs on this machine only.

A local job's processes talk over loopback: the rendezvous is a file, but gloo's pairs listen
on 127.0.0.1, where any local user can connect to them, and gloo hands a listener's first
connection with the right sequence number to the waiting pair, stranger or peer (a stranger's
64 zero bytes used to stall a job's start for good). The zygote that forks a job's processes
therefore moves itself, before it forks them, into a new network namespace whose only
interface is its own loopback: the job's listeners exist there alone, and no process outside
the job can reach them. Unprivileged users get the namespace through a user namespace that
maps their own uid and gid onto themselves (files keep their owner); root needs none.

Where the kernel refuses (user namespaces disabled, a seccomp filter), the job runs on the
machine's loopback as before (the launcher warns), and its groups' start-up check
(`netpart.processes.groups`) still finds a stranger's connection and forms the group again
(a stranger at every attempt ends the job in one line).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct

__all__ = ["enter_private_network", "network_of"]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sH22x"  # struct ifreq: the interface's name, then its flags (and padding)


def enter_private_network() -> str | None:
    """Move this (single-threaded) process into a new network namespace with loopback up;
    None when done, else why not (the process is then where it was)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(flags) != 0:
            return f"unshare: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:  # not Linux
        return f"unshare: {exc}"
    try:
        if flags & CLONE_NEWUSER:
            _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _loopback_up()
    except OSError as exc:  # the namespace exists but is unusable: no network at all
        return f"the new network namespace: {exc}"
    return None


def network_of(pid: int | str = "self") -> str:
    """The network namespace process `pid` is in ('' if it cannot be read)."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/net")
    return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0))
        up = struct.unpack(IFREQ, req)[1] | IFF_UP
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", up))
