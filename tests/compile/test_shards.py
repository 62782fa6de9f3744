"""The parameter layout over shards: pure checks of pieces, routes and cut points."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.compile.shards import ShardLayout, piece_index, shard_bounds
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.partition.methods import METHODS
from tests.conftest import small_specs


def _layout(spec, workers, method, shards):
    p = plan(spec, workers, method, seed=1)
    return ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, workers, shards)


@settings(max_examples=40, deadline=None)
@given(
    spec=small_specs(),
    workers=st.integers(1, 4),
    shards=st.integers(1, 6),
    method=st.sampled_from(sorted(METHODS)),
)
def test_layout_covers_every_parameter_once_and_routes_cover_every_worker(
    spec, workers, shards, method
):
    layout = _layout(spec, workers, method, shards)
    assert layout.total == spec.num_params
    assert layout.shard_sizes().sum() == spec.num_params and (layout.shard_sizes() >= 0).all()
    # Worker-major space -> reference parameters is a bijection.
    hits = {}
    for w in range(workers):
        for piece, off in zip(layout.pieces[w], layout.offsets[w], strict=True):
            for k, g in enumerate(piece_index(spec, piece).tolist()):
                key = (piece.name, g)
                assert hits.setdefault(key, off + k) == off + k  # shared pieces agree
    assert sorted(hits.values()) == list(range(spec.num_params))
    # Each worker's routes cover its flat vector exactly once, inside the shard ranges.
    for w in range(workers):
        covered = np.zeros(layout.worker_size(w), dtype=int)
        for s, segs in layout.routes(w).items():
            for g in segs:
                covered[g.local_lo : g.local_lo + g.length] += 1
                assert g.shard_lo >= 0 and g.shard_lo + g.length <= layout.shard_sizes()[s]
        assert (covered == 1).all()


def test_one_shard_per_worker_when_shards_equal_balanced_workers():
    spec = load_spec("image-80m")
    layout = _layout(spec, 16, "metis", 16)
    assert [sorted(layout.routes(w)) for w in range(16)] == [[w] for w in range(16)]
    layout = _layout(spec, 16, "metis", 5)
    sizes = layout.shard_sizes()
    assert sizes.max() / sizes.mean() < 1.1  # balanced even when workers straddle


def test_shard_bounds_rule():
    assert shard_bounds(np.array([10, 10, 10]), 3).tolist() == [0, 10, 20, 30]
    assert shard_bounds(np.array([10, 10]), 4).tolist() == [0, 5, 10, 15, 20]
    assert shard_bounds(np.array([10, 30]), 2).tolist() == [0, 20, 40]  # 10 is too far from 20
    with pytest.raises(ValueError):
        shard_bounds(np.array([1]), 0)
