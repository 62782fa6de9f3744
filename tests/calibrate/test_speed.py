"""The speed probe (`netpart.calibrate.speed`): what `netpart calibrate` records beside every
run and `netpart run` compares against."""

import time

import pytest
import torch

from netpart.calibrate.speed import SpeedProbe, probe_once


def test_a_probe_samples_at_once_and_then_every_period_and_restores_the_thread_count():
    threads = torch.get_num_threads()
    every = 0.05
    with SpeedProbe(every=every) as probe:
        t0 = time.monotonic()
        deadline = t0 + 30
        while len(probe.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        took = time.monotonic() - t0
    assert len(probe.samples) >= 3
    assert took >= 2 * every * 0.9  # one at once, then one per period: never faster
    assert all(s > 0 for s in probe.samples)
    assert min(probe.samples) <= probe.median() <= max(probe.samples)
    assert torch.get_num_threads() == threads
    assert SpeedProbe().median() == 0.0  # never entered: no sample


def test_a_probe_counts_its_own_cpu_time_not_the_time_it_waits():
    t0 = time.perf_counter()
    cpu = probe_once()
    assert 0 < cpu <= time.perf_counter() - t0


def test_a_probe_s_period_is_positive():
    with pytest.raises(ValueError, match="positive"):
        SpeedProbe(every=0)
