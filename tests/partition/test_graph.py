import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph
from netpart.partition.graph import aligned_pool
from netpart.partition.metis import validate_csr
from tests.conftest import reads, small_specs, unit_owner

granularities = st.builds(
    Granularity,
    spatial_blocks=st.integers(1, 40),
    dense_blocks=st.integers(1, 8),
    align_pools=st.booleans(),
)


@given(small_specs(), granularities)
@settings(max_examples=80, deadline=None)
def test_graph_is_symmetric_and_blocks_cover_every_unit_once(spec, gran):
    g = build_unit_graph(spec, gran)
    validate_csr(g.xadj, g.adjncy, g.vertex_weights(), g.units, g.adjwgt)  # symmetric, no dups
    for lb, shape in zip(g.layers, spec.shapes, strict=True):
        owner = unit_owner(g, np.arange(g.num_vertices), lb.index)  # asserts no unit twice
        assert len(owner) == shape.size
        assert g.units[lb.ids].sum() == shape.size
    assert np.all(g.flops > 0)


@given(small_specs(max_layers=3), granularities)
@settings(max_examples=60, deadline=None)
def test_edges_are_exactly_the_reads_with_their_unit_counts(spec, gran):
    g = build_unit_graph(spec, gran)
    block_of = [unit_owner(g, np.arange(g.num_vertices), i) for i in range(len(spec.layers))]
    want: dict[tuple[int, int], set] = {}
    for i in range(1, len(spec.layers)):
        for unit, reader in block_of[i].items():
            for src in reads(spec, i, unit):
                want.setdefault((reader, block_of[i - 1][src]), set()).add(src)
    u, v, w = g.edge_list()
    got = {}
    for a, b, wt in zip(u.tolist(), v.tolist(), w.tolist(), strict=True):
        reader, source = (a, b) if g.layer_of[a] > g.layer_of[b] else (b, a)
        got[(reader, source)] = wt
    assert got == {k: len(s) for k, s in want.items()}


def test_metis_text_format():
    g = build_unit_graph(ZOO["tiny-mlp"], Granularity(dense_blocks=4))
    lines = g.to_metis_text().splitlines()
    assert lines[0] == f"{g.num_vertices} {g.num_edges} 111 2"
    first = list(map(int, lines[1].split()))
    assert first[0] == g.units[0] and first[1:3] == [g.flops[0], 0]
    neighbours = first[3::2]
    assert sorted(neighbours) == sorted((g.adjncy[g.xadj[0] : g.xadj[1]] + 1).tolist())


def test_networkx_export_has_attributes():
    g = build_unit_graph(ZOO["tiny-local"])
    nxg = g.to_networkx()
    assert nxg.number_of_nodes() == g.num_vertices
    assert nxg.number_of_edges() == g.num_edges
    some = next(iter(nxg.nodes(data=True)))[1]
    assert set(some) == {"layer", "flops", "units", "box"}


def test_largest_model_builds_quickly_at_default_granularity():
    start = time.perf_counter()
    g = build_unit_graph(ZOO["image-1.7b"], Granularity.for_workers(128))
    elapsed = time.perf_counter() - start
    assert g.num_vertices > 30000
    assert elapsed < 60, elapsed  # generous: a sanity bound, timings live in benchmarks/


def test_granularity_reaches_target_by_tiles_then_channels():
    gran = Granularity(spatial_blocks=100)
    assert gran.grid(ZOO["image-80m"].shapes[0], dense=False)[0] == 1  # 91x91: tiles suffice
    nc, ny, nx = gran.grid(ZOO["image-80m"].shapes[7], dense=False)  # 48x4x4
    assert (ny, nx) == (4, 4) and nc * 16 >= 100
    assert list(itertools.islice([gran.grid(ZOO["speech"].shapes[0], dense=True)], 1)) == [
        (16, 1, 1)
    ]


def _pool_inputs_read_once(spec, g) -> tuple[bool, int]:
    """(every input block of each tiling pool with the same channel groups as its input is
    read by exactly one pool block, or by none if no window reads its units; pools checked)."""
    u, v, _ = g.edge_list()
    ok, checked = True, 0
    for i in range(1, len(spec.layers)):
        source, pool = g.layers[i - 1], g.layers[i]
        if not (aligned_pool(spec, i) and spec.layers[i - 1].is_spatial):
            continue
        if not np.array_equal(source.cbounds, pool.cbounds):
            continue
        src = np.concatenate([u[g.layer_of[v] == i], v[g.layer_of[u] == i]])
        src = src[g.layer_of[src] == i - 1]
        readers = np.bincount(src - source.first, minlength=source.count)
        b, s = g.box[source.ids], spec.layers[i].stride
        live = (b[:, 3] <= pool.shape.height * s) & (b[:, 5] <= pool.shape.width * s)
        ok &= bool(np.all(readers[live] == 1) and np.all(readers[~live] == 0))
        checked += 1
    return ok, checked


@given(small_specs(), st.integers(1, 60))
@settings(max_examples=60, deadline=None)
def test_aligned_pool_inputs_are_read_by_one_pool_block_each(spec, blocks):
    assert _pool_inputs_read_once(
        spec, build_unit_graph(spec, Granularity(blocks, align_pools=True))
    )


@pytest.mark.parametrize("workers", [16, 64])  # at 128 the pools have more channel groups
def test_zoo_pools_straddle_blocks_unless_aligned(workers):
    spec = ZOO["image-80m"]
    aligned = build_unit_graph(spec, Granularity.for_workers(workers, align_pools=True))
    plain = build_unit_graph(spec, Granularity.for_workers(workers))
    ok, checked = _pool_inputs_read_once(spec, aligned)
    assert ok and checked >= 1
    assert not _pool_inputs_read_once(spec, plain)[0]
    for a, b in zip(plain.layers, aligned.layers, strict=True):  # only pools' inputs change
        if a.index + 1 == len(spec.layers) or not aligned_pool(spec, a.index + 1):
            assert np.array_equal(a.ybounds, b.ybounds) and np.array_equal(a.cbounds, b.cbounds)
        if len(b.cbounds) > len(a.cbounds):  # more channel groups: only the pool's, and
            assert np.array_equal(b.cbounds, aligned.layers[b.index + 1].cbounds)
            assert b.count <= 2 * a.count  # never many more blocks than the layer wants
    assert (
        Granularity(**{k: v for k, v in Granularity().to_dict().items() if k != "align_pools"})
        == Granularity()
    )
