import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.plane import blocks_from_plane, build_plane, layer_weights, plane_shape
from tests.conftest import small_specs


def _spatial(spec):
    return [i for i, layer in enumerate(spec.layers) if layer.is_spatial]


@given(small_specs(), st.integers(4, 400))
@settings(max_examples=60, deadline=None)
def test_one_constraint_per_layer_each_summing_to_its_flops(spec, max_cells):
    assume(_spatial(spec))
    g = build_unit_graph(spec, Granularity(spatial_blocks=12, dense_blocks=3))
    ny, nx = plane_shape(spec, max_cells)
    assert ny * nx <= max_cells or min(ny, nx) == 1
    w = layer_weights(spec, ny, nx)
    assert w.shape == (ny * nx, len(_spatial(spec)))
    totals = np.bincount(g.layer_of, weights=g.flops)[_spatial(spec)]
    np.testing.assert_allclose(w.sum(axis=0), totals, rtol=1e-9)
    plane = build_plane(spec, max_cells)
    assert 1 <= plane.vwgt.shape[1] <= len(_spatial(spec)) and np.all(plane.vwgt > 0)
    src = np.repeat(np.arange(plane.cells), np.diff(plane.xadj))
    fwd, rev = src * plane.cells + plane.adjncy, plane.adjncy * plane.cells + src
    assert sorted(fwd.tolist()) == sorted(rev.tolist())  # symmetric 4-neighbour grid


@given(small_specs(), st.integers(1, 5), st.integers(0, 2**16), st.integers(4, 60))
@settings(max_examples=60, deadline=None)
def test_every_spatial_block_gets_an_owner_of_its_region(spec, workers, seed, blocks):
    assume(_spatial(spec))
    g = build_unit_graph(spec, Granularity(spatial_blocks=blocks, dense_blocks=3))
    plane = build_plane(spec)
    owner = np.random.default_rng(seed).integers(0, workers, plane.cells)
    out = np.full(g.num_vertices, -1)
    blocks_from_plane(g, plane, owner, workers, out)
    spatial = np.isin(g.layer_of, _spatial(spec))
    assert np.all((out[spatial] >= 0) & (out[spatial] < workers))
    assert np.all(out[~spatial] == -1)  # dense layers are left to the method
    present = set(owner.tolist())
    assert set(out[spatial].tolist()) <= present  # nobody outside the plane's owners
    one = np.full(g.num_vertices, -1)
    blocks_from_plane(g, plane, np.full(plane.cells, workers - 1), workers, one)
    assert np.all(one[spatial] == workers - 1)  # a whole plane owned by one: everything


def test_metis_on_the_layer_aligned_graph_is_near_the_bound_and_balanced():
    p = plan(ZOO["image-80m"], 16, "metis-aligned")
    assert p.metrics.volume_ratio <= 1.25 and p.metrics.max_layer_imbalance <= 1.05
    assert p.granularity.align_pools  # the pools' inputs may follow the pools
