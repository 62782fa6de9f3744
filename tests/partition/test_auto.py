import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.cost.machine import Machine
from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.evaluate import reevaluate, screen, step_floor
from netpart.partition.planner import AUTO_RULE, TIE, Planner, auto_candidates, choose
from netpart.partition.plans import Candidate, PartitionPlan, PlanMetrics
from netpart.planning.report import auto_table
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


@given(small_specs(), st.integers(2, 6), st.sampled_from(["metis", "tiles", "stripe", "random"]))
@settings(max_examples=60, deadline=None)
def test_the_screen_never_exceeds_the_evaluated_step(spec, workers, method):
    """A candidate is skipped by a lower bound on its step: it must be one, on any plan (its
    other figures are the evaluation's own)."""
    grain = Granularity(spatial_blocks=16, dense_blocks=4)
    p = plan(spec, workers, method, granularity=grain)
    graph = build_unit_graph(spec, p.granularity)
    for network in (Machine(), Machine(overlap=False)):
        full = reevaluate(spec, p, p.batch, network).metrics
        floor = step_floor(graph, p.node_map, workers, p.batch, network)
        assert floor <= full.predicted_step_s * (1 + 1e-12)
        cheap = screen(graph, p.node_map, workers, None, floor)
        same = ("edge_cut", "volume", "lower_bound", "max_layer_imbalance")
        assert all(getattr(cheap, k) == getattr(full, k) for k in same)


def test_a_candidate_that_cannot_win_is_skipped_and_recorded():
    """With a step to beat below its lower bound, a candidate is screened out: recorded with
    why, its figures exact but its step a bound, never chosen, and the plan file round trips."""
    spec = ZOO["tiny-local"]
    runner = Planner(spec, 2, 0, 32, Machine(), Granularity.for_workers(2), lambda _: None)
    evaluated = runner("tiles", {})
    skipped = runner("metis", {}, beat=1e-9)
    assert skipped.skipped.startswith("its compute alone") and skipped.metrics.exchange_s == 0
    candidates = (Candidate("tiles", {}, evaluated.metrics), skipped)
    assert choose(candidates) == 0 and choose(candidates[::-1]) == 1
    p = dataclasses.replace(evaluated, candidates=candidates, rule=AUTO_RULE)
    back = PartitionPlan.from_json(p.to_json(), p.node_map)
    assert back == p and back.candidates[1].skipped == skipped.skipped
    assert "not evaluated" in auto_table(p)
