import itertools
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph
from netpart.partition._metis import validate_csr
from tests.conftest import reads, small_specs, unit_owner

granularities = st.builds(
    Granularity, spatial_blocks=st.integers(1, 40), dense_blocks=st.integers(1, 8)
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
