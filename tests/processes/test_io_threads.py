"""gloo's I/O threads: netpart's processes make them SCHED_BATCH, and `policy` SCHED_OTHER
puts them back as gloo starts them (the all-reduce was timed both ways by
`benchmarks/ring_bench.py`, in git at 8cf7780); no other thread is touched. A group's I/O
thread outlives its destruction while the group is held."""

from __future__ import annotations

import os
import threading

from netpart.processes.launcher import gloo_io_threads, yield_io_threads


def test_gloo_loop_threads_yield_and_are_put_back():
    done, tids, named = threading.Event(), {}, threading.Barrier(3)

    def run(name: str) -> None:
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/comm", "w") as fh:
            fh.write(name)  # the loop: as gloo names its I/O thread
        tids[name] = tid
        named.wait(10)
        done.wait(30)

    threads = [
        threading.Thread(target=run, args=(n,), daemon=True) for n in ("gloo_tcp_loop", "worker")
    ]
    for t in threads:
        t.start()
    try:
        named.wait(10)
        loop, other = tids["gloo_tcp_loop"], tids["worker"]
        assert yield_io_threads() == 1
        assert os.sched_getscheduler(loop) == os.SCHED_BATCH
        assert os.sched_getscheduler(other) == os.SCHED_OTHER
        assert yield_io_threads() == 0  # already so
        assert yield_io_threads(os.SCHED_OTHER) == 1
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER
    finally:
        done.set()
        for t in threads:
            t.join(10)


def test_a_destroyed_group_s_io_thread_runs_until_nothing_holds_it(tmp_path):
    """Why the calibration lets go of its groups before it times the all-reduce
    (`HostsRunner._leave`): destroying them alone leaves their I/O threads waking."""
    import gc

    import torch.distributed as dist

    gc.collect()  # an earlier test's unreferenced group would end its thread during this one
    before = len(gloo_io_threads())
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    held = [dist.new_group([0]) for _ in range(2)]
    assert len(gloo_io_threads()) > before
    dist.destroy_process_group()
    assert len(gloo_io_threads()) > before  # the groups still held
    del held
    gc.collect()
    assert len(gloo_io_threads()) == before
