"""experiments/validate_sim.py's rows: each launched several times at different moments, the
row their median (the emulated machines themselves need root and 20 minutes: not here)."""

from dataclasses import replace

import numpy as np

from experiments import validate_sim
from netpart.cost.machine import Machine


class _Runner:
    """Stands in for the emulated machines: the k-th launch of anything takes steps[k]."""

    share = 0.5

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.launched = seconds, []

    def run(self, spec, p, batch, steps):
        self.launched.append((spec.name, p.workers))
        t = self.seconds[len(self.launched) - 1]
        return np.full(steps, t), 0.25 * t


def test_each_row_is_the_median_of_launches_in_passes():
    cases = [("tiny-mlp", 2), ("tiny-mlp", 3), ("tiny-local", 2), ("tiny-local", 3)]
    runner = _Runner([0.010, 0.020, 0.030, 0.040, 0.014, 0.024, 0.034, 0.044, 0.5, 0.5, 0.5, 0.5])
    model = replace(Machine(), probe_s=1.0)
    rows = validate_sim._run(runner, model, ["tiny-mlp", "tiny-local"], [2, 3], 1, 3, "runner")
    assert runner.launched == cases * 3  # a pass over every row, then the next
    assert [(r["model"], r["workers"]) for r in rows] == cases
    first = rows[0]
    assert first["launches_ms"] == [10.0, 14.0, 500.0]
    assert first["measured_ms"] == 14.0  # the median: one slow launch does not decide it
    assert first["cpu_floor_ms"] == 0.25 * 14.0 / 0.5
    assert first["error"] == first["predicted_ms"] / 14.0 - 1
    assert len(first["slowdowns"]) == 3 and first["slowdown"] == np.median(first["slowdowns"])
    assert validate_sim._flat(first)["launches_ms"] == "10 14 500"
    rows = validate_sim._run(_Runner([0.01] * 4), Machine(), ["tiny-mlp"], [2], 2, 1, "runner")
    assert rows[0]["slowdown"] is None and rows[0]["launches_ms"] == [10.0]  # no probe_s
