import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.compile.schedule import build_schedule
from netpart.compile.shards import channel_groups
from netpart.models import ZOO
from netpart.partition import METHODS as ALL_METHODS
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.evaluate import input_values
from netpart.partition.volume import layer_lower_bounds, layer_traffic
from netpart.runtime.slices import window_index
from tests.conftest import brute_force_volume, graph_specs, small_specs

METHODS = sorted(ALL_METHODS)  # every partitioner, new ones included


@given(small_specs(max_layers=3), st.integers(1, 4), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_traffic_equals_a_unit_level_recount_for_any_assignment(spec, workers, seed):
    g = build_unit_graph(spec, Granularity(spatial_blocks=12, dense_blocks=3))
    node_map = np.random.default_rng(seed).integers(0, workers, g.num_vertices)
    t = layer_traffic(g, node_map, workers)
    assert t.sum(axis=(1, 2)).tolist() == brute_force_volume(g, node_map)
    assert np.all(np.diagonal(t, axis1=1, axis2=2) == 0)


@given(small_specs(max_layers=3), st.integers(1, 4), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_input_values_count_what_each_worker_s_slice_gathers(spec, workers, seed):
    """The cost model's values per slice are the runtime's own gathers, unit by unit: a window
    of every input channel per position and channel group (local, conv), a window of the
    unit's channel (pool), the whole input (dense)."""
    g = build_unit_graph(spec, Granularity(spatial_blocks=12, dense_blocks=3))
    node_map = np.random.default_rng(seed).integers(0, workers, g.num_vertices)
    got = input_values(g, node_map, workers, layer_traffic(g, node_map, workers))
    owned = build_schedule(g, node_map, workers).owned
    for i, layer in enumerate(spec.layers):
        n_in, out = spec.input_shape(i).size, spec.shapes[i]
        for w in range(workers):
            units = owned[i][w]
            if layer.kind in ("local", "conv"):
                groups = channel_groups(spec, i, units, g.layers[i])
                want = sum(window_index(spec, i, pos, None, n_in).size for _, _, pos, _ in groups)
            elif layer.kind == "pool":
                channel, position = np.divmod(units, out.height * out.width)
                want = window_index(spec, i, position, channel, n_in).size
            elif layer.kind == "dense":
                want = n_in if len(units) else 0
            else:  # lcn: its input buffer
                continue
            assert got[i, w] == want, (i, layer.kind, w)


@given(st.one_of(small_specs(), graph_specs()), st.integers(1, 4), st.sampled_from(METHODS))
@settings(max_examples=100, deadline=None)
def test_plan_volume_recounts_and_respects_the_bound(spec, workers, method):
    """Every method's plan of a chain or a layer graph: its volume recounted unit by unit,
    at least the bound."""
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=16, dense_blocks=4))
    g = build_unit_graph(spec, p.granularity)
    per_layer = brute_force_volume(g, p.node_map)
    assert p.metrics.volume == sum(per_layer)
    assert [ly.volume for ly in p.layers] == per_layer
    assert p.metrics.lower_bound <= p.metrics.volume


def test_dense_bound_is_an_all_gather():
    spec = ZOO["speech"]
    q = np.array([8] * 5)
    lb = layer_lower_bounds(spec, q)
    assert lb.tolist() == [0, 7 * 2560, 7 * 2560, 7 * 2560, 7 * 2560]
    p = plan(spec, 8, "stripe")
    assert p.metrics.volume == p.metrics.lower_bound


def test_spatial_bound_is_the_halo_of_a_regular_tiling():
    # Layer 1 (3x3, stride 1) maps a 2-channel 10x10 input to 8x8.
    from netpart.models import ModelSpec

    spec = ModelSpec.from_dict(
        {
            "name": "t",
            "input": {"channels": 1, "height": 12, "width": 12},
            "layer": [
                {"kind": "conv", "channels": 2, "kernel": 3},
                {"kind": "local", "channels": 1, "kernel": 3},
            ],
        }
    )
    # Two 4x8 tiles each read 6x10 inputs: 2 * 60 - 100 = 20 positions, x 2 channels.
    assert layer_lower_bounds(spec, np.array([2, 2])).tolist() == [0, 40]
    # Four 4x4 tiles each read 6x6: 4 * 36 - 100 = 44 (strips would give 4 * 40 - 100 = 60).
    assert layer_lower_bounds(spec, np.array([4, 4])).tolist() == [0, 88]


def test_a_layer_on_more_workers_than_output_positions_keeps_a_true_bound():
    """Four workers share a local layer of 2 channels x 3 positions: no brick tiling of 3
    positions has 4 tiles, and two channel groups of 2 tiles each (bound 12) miss the plan
    that splits one position's channels (two tiles of 4 inputs past the 3 positions')."""
    from netpart.models import ModelSpec

    spec = ModelSpec.from_dict(
        {
            "name": "t",
            "input": {"channels": 1, "height": 8, "width": 5},
            "layer": [
                {"kind": "pool", "kernel": 2},
                {"kind": "lcn", "kernel": 1},
                {"kind": "local", "channels": 2, "kernel": 2},
            ],
        }
    )
    # Three positions' windows (2x2 of a 4x2 input): halo(3) = 3 * 4 - 8 = 4, plus 4.
    assert layer_lower_bounds(spec, np.array([1, 1, 4])).tolist() == [0, 0, 8]
    p = plan(spec, 4, "metis", granularity=Granularity(spatial_blocks=16, dense_blocks=4))
    assert p.metrics.lower_bound <= p.metrics.volume
