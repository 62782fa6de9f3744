"""The parameter server's exchange as calibration measures it: a layout of one worker whose
values shards hold in even ranges; two clients and a shard (or a client and two shards) run
the loop in both modes through the real client and server, every client reports a time and
its CPU per exchange at each size, a shard none, and every process ends; a client runs what
it is given beside the exchange before each request; and every rank all-reduces, with or
without a step before each."""

from __future__ import annotations

import time

import pytest

from netpart.compile.shards import Segment
from netpart.ps.timed_exchange import WARM, flat_layout, stand_in, timed_calls, warm_exchanges
from tests.ps.roles import run_roles


def test_a_flat_layout_is_even_segments_of_its_shards():
    layout = flat_layout(1000)
    assert layout.total == 1000 and layout.worker_size(0) == 1000
    assert layout.routes(0) == {0: (Segment(0, 0, 1000),)} and layout.peers(0) == [0]
    three = flat_layout(1000, 3)
    assert three.shard_sizes().tolist() == [333, 334, 333]
    assert three.routes(0)[2] == (Segment(667, 0, 333),)


@pytest.mark.parametrize("clients,shards", [(2, 1), (1, 2)])
def test_clients_time_their_exchanges_and_the_shards_serve_them(tmp_path, clients, shards):
    got = run_roles(tmp_path, clients + shards, ["timed", str(shards)])
    for mode in ("sync", "downpour"):
        for client in got[:clients]:
            seconds, cpu = client[mode]
            assert len(seconds) == len(cpu) == 2 and min(seconds) > 0 and min(cpu) > 0
        for shard in got[clients:]:
            assert shard[mode] == [[0.0, 0.0], [0.0, 0.0]]
    for client in got[:clients]:  # beside: before each request, warm ones too; paced by it
        (seconds, _), calls = client["beside"]
        assert calls == WARM + 4 and seconds[0] >= 0.01
        for mode in ("sync", "downpour"):
            calls = client["large_" + mode][1]
            assert calls == warm_exchanges(mode, 4_000_000) + 2 == (1 if mode == "sync" else 2) + 2
    assert all(shard["beside"][1] == 0 for shard in got[clients:])
    for every in got:  # all-reduce: every rank all-reduces, times it and its CPU
        seconds, cpu = every["allreduce"]
        assert len(seconds) == len(cpu) == 2 and min(seconds) > 0 and min(cpu) > 0
        (seconds, _), calls = every["ring_beside"]  # before each all-reduce, on every rank
        assert calls == 3 + 3 and seconds[0] >= 0.01


def test_timed_calls_warms_then_times_each_call():
    """`timed_calls` runs WARM untimed calls, then `repeats` timed ones, and gives the mean
    seconds and CPU seconds of one: a call that sleeps 10 ms takes at least that, and little
    CPU."""
    calls = []
    seconds, cpu = timed_calls(lambda: (calls.append(1), time.sleep(0.01)), 3)
    assert len(calls) == WARM + 3
    assert seconds >= 0.01
    assert 0 <= cpu < seconds


def test_a_stand_in_step_spends_its_cpu_on_the_calling_thread():
    """`stand_in` computes until its thread has spent the CPU it was given (a step's), and
    no more than a matrix product beyond it."""
    step = stand_in(0.02, 1000)
    for _ in range(3):
        t0 = time.thread_time()
        step()
        spent = time.thread_time() - t0
        assert 0.02 <= spent < 0.05
