"""The calibration's all-reduce in processes of their own: the ranks meet beside the job's
store and rank 0 gets the slowest rank's time and CPU per size, the others nothing; every
number of machines in turn, each ring finished on every rank before the next; a ring whose
peer never comes ends in one line within its timeout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from netpart.calibrate.hosts import read_ring_plan
from netpart.calibrate.ring import rings, timed
from netpart.errors import CalibrationError, ProtocolError
from netpart.processes.launcher import STORE_ENV

pytestmark = pytest.mark.timeout(120)


def test_every_number_of_machines_times_its_ring_one_after_another(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    sizes, repeats = [4096, 65536], [4, 2]  # a count per size
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(rings, r, 3, sizes, repeats, 60.0) for r in (0, 1, 2)]
        tables, *others = (run.result() for run in runs)
    assert others == [{}, {}] and sorted(tables) == [2, 3]
    for seconds, cpu in tables.values():
        assert len(seconds) == len(cpu) == 2 and min(seconds) > 0 and min(cpu) > 0


def test_a_ring_without_its_peer_ends_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    with pytest.raises(CalibrationError) as info:
        timed(0, 2, "ring1", [4096], [3], 2.0)
    message = str(info.value)
    assert "\n" not in message and "calibration rank 0: the all-reduce's own process" in message


def test_a_follower_takes_only_an_all_reduce_it_can_time_from_rank_0():
    plan = {"sizes": [16_000, 64_000], "repeats": [30, 30]}
    assert read_ring_plan(plan, 1) == plan and read_ring_plan(None, 1) is None
    bad_plans = (
        {"sizes": [16_000]},
        {"sizes": [16_000], "repeats": [0]},
        {"sizes": [], "repeats": []},
        {"sizes": ["16kB"], "repeats": [3]},
        [1, 2],
    )
    for bad in bad_plans:
        with pytest.raises(ProtocolError) as info:
            read_ring_plan(bad, 1)
        assert "\n" not in str(info.value) and "calibration rank 1" in str(info.value)
