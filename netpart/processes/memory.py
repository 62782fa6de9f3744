"""A process's memory: keep what it frees for reuse (no torch: the planner uses it too)."""

from __future__ import annotations

import ctypes
import os

__all__ = ["available_memory", "keep_freed_memory", "processes_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of returning it to the
    kernel (an mmap threshold of 1 GiB, no trimming); returns whether glibc took it.

    Why: a training step frees and allocates the same large tensors every time, and a plan
    of a large model builds and drops arrays of hundreds of MB over and over. By default
    glibc serves each from fresh mmap'd pages and unmaps them on free, so every one is
    faulted in again, zeroed by the kernel (docs/runtime.md). The process keeps its peak
    memory instead.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(1 << 30))
        trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mmap_ok and trim_ok)


def processes_memory(pids) -> int:
    """Bytes the processes `pids` hold between them: the sum of their proportional set sizes
    (a page shared by k of them counts 1/k to each, so the torch a zygote's children share
    is counted once), their resident sizes where the kernel has no PSS; 0 for a process that
    has ended."""
    total = 0
    for pid in pids:  # a loop over a job's processes, not its pages
        for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
            try:
                with open(path) as f:
                    line = next((ln for ln in f if ln.startswith(key)), None)
            except OSError:
                continue
            if line is not None:
                total += int(line.split()[1]) * 1024
                break
    return total


def available_memory() -> int:
    """Bytes the kernel says a new process can use without swapping (MemAvailable), else
    the machine's physical memory, else a bound no plan reaches."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return 2**62
