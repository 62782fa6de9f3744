import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.models import ZOO
from netpart.partition import Granularity, plan
from netpart.partition.planner import TIE, auto_candidates, choose
from netpart.partition.plans import Candidate, PartitionPlan, PlanMetrics
from tests.conftest import small_specs


def _metrics(step: float, volume: int) -> PlanMetrics:
    return PlanMetrics(0, volume, 1, 1.0, step, step, 0.0)


def test_choose_takes_the_fastest_and_breaks_near_ties_by_volume():
    far = (Candidate("a", {}, _metrics(1.0, 50)), Candidate("b", {}, _metrics(1.5, 10)))
    assert choose(far) == 0  # 50% slower is not a tie, however little it sends
    near = (Candidate("a", {}, _metrics(1.0, 50)), Candidate("b", {}, _metrics(1.01, 10)))
    assert choose(near) == 1  # within TIE: the lower volume wins
    same = (Candidate("a", {}, _metrics(1.0, 10)), Candidate("b", {}, _metrics(1.0, 10)))
    assert choose(same) == 0


@given(small_specs(), st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_auto_returns_the_candidate_its_rule_picks(spec, workers):
    p = plan(spec, workers, granularity=Granularity(spatial_blocks=16, dense_blocks=4))
    assert [(c.method, c.options) for c in p.candidates] == [
        (m, o) for m, o in auto_candidates(spec, workers)
    ]
    fastest = min(c.metrics.predicted_step_s for c in p.candidates)
    tied = [c for c in p.candidates if c.metrics.predicted_step_s <= fastest * (1 + TIE)]
    assert p.metrics.predicted_step_s <= fastest * (1 + TIE)
    assert p.metrics.volume == min(c.metrics.volume for c in tied)
    chosen = p.candidates[choose(p.candidates)]
    assert (p.method, p.metrics) == (chosen.method, chosen.metrics)
    again = plan(spec, workers, chosen.method, **chosen.options, granularity=Granularity(16, 4))
    assert np.array_equal(again.node_map, p.node_map)  # the recorded winner re-runs alike


def test_auto_weighs_both_metis_graphs_and_tiles_and_records_them():
    p = plan(ZOO["image-80m"], 16)
    names = [c.method for c in p.candidates]
    assert {"metis", "metis-aligned", "tiles"} <= set(names)
    assert p.metrics.volume_ratio <= 1.10 and p.metrics.max_layer_imbalance <= 1.05
    back = PartitionPlan.from_json(p.to_json(), p.node_map)
    assert back == p and back.candidates == p.candidates
    assert "auto" not in plan(ZOO["image-80m"], 16, "tiles").to_dict()
    speech = plan(ZOO["speech"], 8)
    assert [c.method for c in speech.candidates] == ["metis", "stripe"]
    stripe = next(c for c in speech.candidates if c.method == "stripe")
    assert speech.metrics.predicted_step_s <= stripe.metrics.predicted_step_s


def test_a_plan_without_candidates_loads_as_before():
    p = plan(ZOO["tiny-local"], 2, "metis")
    d = p.to_dict()
    assert "auto" not in d and p.candidates == ()
    assert dataclasses.replace(p, candidates=()) == p
