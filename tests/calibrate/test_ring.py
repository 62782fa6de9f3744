"""The calibration's all-reduce in processes of their own: the ranks meet beside the job's
store and rank 0 gets the slowest rank's time and CPU per size, the others zeros; a ring
whose peer never comes ends in one line within its timeout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from netpart.calibrate.ring import timed
from netpart.errors import CalibrationError
from netpart.processes.launcher import STORE_ENV

pytestmark = pytest.mark.timeout(120)


def test_two_ranks_time_their_ring(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    sizes = [4096, 65536]
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(timed, r, 2, "ring1", sizes, 3, 60.0) for r in (0, 1)]
        (seconds, cpu), other = (run.result() for run in runs)
    assert len(seconds) == len(cpu) == 2 and min(seconds) > 0 and min(cpu) > 0
    assert other == ([0.0, 0.0], [0.0, 0.0])


def test_a_ring_without_its_peer_ends_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    with pytest.raises(CalibrationError) as info:
        timed(0, 2, "ring1", [4096], 3, 2.0)
    message = str(info.value)
    assert "\n" not in message and "calibration rank 0: the all-reduce's own process" in message
