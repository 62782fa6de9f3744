"""Where a partitioned step's time goes.

Two sources. The worker times every instruction of its program by category
(`netpart.runtime.state.BREAKDOWN`): `slice` (the layer's arithmetic, forward and autograd),
`fill` (building input buffers, payloads and received-gradient sums: gathers and scatters),
`post` (handing messages to the transport), `wait` (blocked until the halo is in: transfer
plus waiting for the slower peer) and `loss` (the loss and its one collective); what the
step's wall time holds beyond them is `other` (the interpreter between instructions). And
the kernel, per thread (`/proc/self/task/*/schedstat`): CPU time, and time spent runnable but
waiting for a core — of the compute thread, of gloo's I/O thread (`gloo_tcp_loop`) and of
its collective workers (`pt_gloo_runloop`).
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["THREAD_GROUPS", "step_breakdown", "thread_medians", "thread_usage"]

THREAD_GROUPS = {"gloo_tcp_loop": "gloo_io", "pt_gloo_runloop": "gloo_collectives"}


def thread_usage() -> dict[str, float]:
    """Seconds of CPU (`<group>_cpu_s`, from each thread's CPU clock) and of run-queue wait
    (`<group>_runqueue_s`, from schedstat, updated at context switches) of this process's
    threads so far, grouped: `main`, `gloo_io`, `gloo_collectives`, `other`."""
    out: dict[str, float] = {}
    main = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                wait_ns = int(fh.read().split()[1])
            cpu = time.clock_gettime(_thread_clock(int(tid)))
        except (OSError, ValueError, IndexError):  # the thread ended, or not Linux
            continue
        group = "main" if int(tid) == main else THREAD_GROUPS.get(name, "other")
        out[f"{group}_cpu_s"] = out.get(f"{group}_cpu_s", 0.0) + cpu
        out[f"{group}_runqueue_s"] = out.get(f"{group}_runqueue_s", 0.0) + wait_ns / 1e9
    return out


def _thread_clock(tid: int) -> int:
    """Linux's CPU-time clock id of thread `tid` of this process (CPUCLOCK_SCHED, per
    thread: what pthread_getcpuclockid returns)."""
    return ((~tid) << 3) | 6


def step_breakdown(step_times: list[float], breakdowns: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per step of each category, and `other` (the rest of the step)."""
    if not breakdowns:
        return {}
    keys = sorted(breakdowns[0])
    out = {k: statistics.median(p[k] for p in breakdowns) for k in keys}
    rest = [t - sum(p.values()) for t, p in zip(step_times, breakdowns, strict=True)]
    out["other"] = max(0.0, statistics.median(rest))
    out["step"] = statistics.median(step_times)
    return out


def thread_medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median per step of each thread figure (groups with no CPU at all left out)."""
    if not steps:
        return {}
    keys = sorted(set().union(*steps))
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    idle = {k.removesuffix("_cpu_s") for k, v in med.items() if k.endswith("_cpu_s") and v == 0}
    return {k: v for k, v in med.items() if k.rsplit("_", 2)[0] not in idle}
