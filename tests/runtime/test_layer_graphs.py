"""The central invariant on layer graphs: a partitioned step of a spec whose layers branch,
merge (add, concat) and normalise a batch equals the single-process reference (float64):
loss, outputs, every gradient and the batch norms' running statistics, with the plan's bytes,
whatever the plan; and a user's residual network with batch norm equals the user's module."""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from netpart.compile.schedule import build_schedule
from netpart.errors import SpecError
from netpart.models import ZOO, build_reference
from netpart.partition import METHODS as ALL_METHODS
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.runtime.check import check_step, make_batch
from netpart.runtime.inprocess import run_step_threads
from tests.conftest import graph_specs
from tests.runtime.test_threads import assert_equal_to_reference

METHODS = sorted(ALL_METHODS)


def assert_statistics_equal(spec, result, inputs):
    """The running statistics each batch norm kept equal the reference's after its step."""
    model = build_reference(spec, 0, torch.float64)
    model(inputs)
    buffers = dict(model.named_buffers())
    names = [n for n in buffers if n.endswith(("running_mean", "running_var"))]
    assert sorted(result.statistics) == sorted(names)
    for name in names:
        assert torch.allclose(result.statistics[name], buffers[name], rtol=1e-9, atol=1e-12), name


@given(graph_specs(), st.integers(1, 4), st.sampled_from(METHODS), st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_a_partitioned_step_of_a_layer_graph_equals_the_reference(spec, workers, method, batch):
    try:
        spec.require_batch(batch)
    except SpecError:  # a batch norm of one value per channel: torch's refuses it too
        assume(False)
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    x, y = make_batch(spec, batch, 5)
    result = run_step_threads(spec, p, x, y)
    assert_equal_to_reference(spec, result, x, y)
    assert_statistics_equal(spec, result, x)
    graph = build_unit_graph(spec, p.granularity)
    traffic = build_schedule(graph, p.node_map, workers).traffic() * batch * 8
    for w in range(workers):
        for layer in range(1, len(spec.layers)):
            assert result.sent[w].get((layer, "forward"), 0) == traffic[layer, w].sum()
            assert result.received[w].get((layer, "backward"), 0) == traffic[layer, w].sum()
    assert sum(ly.volume for ly in p.layers) == traffic.sum() // (batch * 8)


def test_the_zoo_resnet_20_checks_equal_at_three_workers():
    spec = ZOO["resnet-20"]
    report, _ = check_step(spec, plan(spec, 3, "metis"), batch=2)
    assert report.ok, report
    assert any("running_var" in d.name for d in report.differences)
