"""Which layers to split to hide their halo: the cost model's choice, recorded in the plan,
followed by the programs, and never changing what a step computes."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from netpart.compile.schedule import plan_schedule
from netpart.cost.machine import Machine
from netpart.cost.overlap import apply, choose_splits
from netpart.models import ZOO
from netpart.partition import plan
from netpart.partition.plans import PartitionPlan


def test_a_split_pays_when_its_halo_outlasts_what_it_adds():
    phase = np.array([[0.0, 0.0], [10.0, 10.0], [1.0, 1.0], [10.0, 0.0]])
    hide = np.array([[0.0, 0.0], [8.0, 8.0], [8.0, 8.0], [8.0, 8.0]])
    split = choose_splits(phase, hide, hide, split_cost=0.25)
    # no halo; hides 16 of 20 for 4; hides 2 for 4; one worker hides 16, both add 8
    assert split.tolist() == [False, True, False, True]
    assert choose_splits(phase, hide, hide, split_cost=0.0).tolist() == [False, True, True, True]


def test_a_layer_not_split_hides_nothing_and_a_split_one_costs_work():
    work, share = np.full((2, 1), 10.0), np.full((2, 1), 0.4)
    hide_f, hide_b = np.full((2, 1), 2.0), np.full((2, 1), 3.0)
    total, new_share, f, b = apply(np.array([True, False]), work, share, hide_f, hide_b, 0.5)
    assert total.ravel().tolist() == [12.5, 10.0]
    assert f.ravel().tolist() == [2.0, 0.0] and b.ravel().tolist() == [3.0, 0.0]
    assert new_share[0, 0] == pytest.approx((4.0 + 1.0) / 12.5) and new_share[1, 0] == 0.4


def test_a_slow_link_splits_what_a_fast_one_joins():
    """bench-local on 2 workers: at 1 Gbit/s no halo is worth a split, at 100 Mbit/s the LCN's
    and the second local layer's are; each prediction at most that of splitting every layer
    it can and of splitting none."""
    spec = ZOO["bench-local"]
    chosen = {}
    for bandwidth in (1e9, 1e8):
        net = Machine(bandwidth_bps=bandwidth)
        p = plan(spec, 2, "metis", batch=32, network=net)
        chosen[bandwidth] = [layer.name for layer in p.layers if layer.split]
        assert any(layer.hideable_s > 0 for layer in p.layers)
        every = replace(net, split_cost=0.0)  # splitting is free: everything that can
        free = plan(spec, 2, "metis", batch=32, network=every)
        assert {layer.name for layer in free.layers if layer.hideable_s > 0} == {
            layer.name for layer in free.layers if layer.split
        }
    assert chosen[1e9] == [] and chosen[1e8] == ["2:lcn", "3:local"]


def test_the_choice_round_trips_and_old_plans_split_everything():
    spec = ZOO["bench-local"]
    p = plan(spec, 2, "metis", batch=32, network=Machine(bandwidth_bps=1e8))
    back = PartitionPlan.from_json(json.dumps(p.to_dict()), p.node_map)
    assert back == p and [ly.split for ly in back.layers] == [ly.split for ly in p.layers]
    old = p.to_dict()
    for layer in old["layers"]:
        del layer["split"], layer["hideable_s"]
    assert all(ly.split for ly in PartitionPlan.from_json(json.dumps(old), p.node_map).layers)


def test_the_programs_split_only_the_layers_the_plan_chose():
    spec = ZOO["bench-local"]
    p = plan(spec, 2, "metis", batch=32, network=Machine(bandwidth_bps=1e8))
    _, chosen = plan_schedule(spec, p, validate=False)
    _, every = plan_schedule(spec, p, validate=False, split=())
    split = [layer.split for layer in p.layers]
    for w in range(2):
        for layer in range(len(split)):
            if not split[layer]:
                assert not chosen.split_forward(w, layer) and not chosen.split_backward(w, layer)
            both = every.split_forward(w, layer) and split[layer]
            assert chosen.split_forward(w, layer) == both
        assert all(split[b + 1] for _, b in chosen.chains[w])
    assert any(every.chains) and sum(map(len, every.chains)) >= sum(map(len, chosen.chains))


def test_the_report_says_which_layers_split_and_what_they_could_hide_behind():
    from netpart.planning.report import layer_table

    spec = ZOO["bench-local"]
    p = plan(spec, 2, "metis", batch=32, network=Machine(bandwidth_bps=1e8))
    lines = [line for line in layer_table(p).splitlines() if line.startswith("|")]
    rows = {line.split("|")[1].strip(): line for line in lines[2:]}
    assert "| split" in lines[0]
    assert "yes (" in rows["2:lcn"] and "yes (" in rows["3:local"]
    assert rows["0:local"].rstrip().rstrip("|").rstrip().endswith("-")
