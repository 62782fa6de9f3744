"""The plan report's headline figures (issue 80, item 5)."""

import pytest

from netpart.models import ZOO
from netpart.partition import plan
from netpart.planning.report import summary_line, weighted_imbalance


def test_the_headline_imbalance_weighs_layers_by_their_cost():
    """A 10-unit output layer that costs nothing set the headline at 1.600 where the step's
    compute was balanced: the headline weighs each layer by its compute."""
    p = plan(ZOO["tiny-local"], 3)
    slowest = sum(ly.compute_s for ly in p.layers)
    mean = sum(ly.compute_s / ly.imbalance for ly in p.layers)
    assert weighted_imbalance(p) == pytest.approx(slowest / mean)
    assert 1.0 <= weighted_imbalance(p) <= p.metrics.max_layer_imbalance
    line = summary_line(p)
    assert f"imbalance {weighted_imbalance(p):.3f} weighted by layer cost" in line
    assert "uncalibrated" in line and "calibrate (`netpart calibrate`) for figures" in line
