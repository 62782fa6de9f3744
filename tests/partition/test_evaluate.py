"""A plan's figures, vectorised: `chain_shares` and `interior_shares` against the loops they
replaced (kept here as the reference), on random specs and plans."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.evaluate import chain_shares, interior_shares
from tests.conftest import chain_specs, small_specs


def _interior_loop(graph, node_map, workers):
    u, v = graph.edge_list()[:2]
    reader = np.where(graph.layer_of[u] > graph.layer_of[v], u, v)
    boundary = np.zeros(graph.num_vertices, dtype=bool)
    boundary[reader[node_map[u] != node_map[v]]] = True
    shape = (len(graph.layers), workers)
    total, inner = np.zeros(shape), np.zeros(shape)
    np.add.at(total, (graph.layer_of, node_map), graph.units)
    keep = ~boundary
    np.add.at(inner, (graph.layer_of[keep], node_map[keep]), graph.units[keep])
    return np.divide(inner, total, out=np.zeros(shape), where=total > 0)


def _chains_loop(graph, node_map, workers):
    """The implementation `chain_shares` replaced: a loop over workers and their tops."""
    u, v = graph.edge_list()[:2]
    lo = np.where(graph.layer_of[u] < graph.layer_of[v], u, v)
    hi = np.where(graph.layer_of[u] < graph.layer_of[v], v, u)
    cross = node_map[lo] != node_map[hi]
    shape = (len(graph.layers), workers)
    total = np.zeros(shape)
    np.add.at(total, (graph.layer_of, node_map), graph.units)
    receives, sends = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    receives[graph.layer_of[hi[cross]], node_map[hi[cross]]] = True
    sends[graph.layer_of[hi[cross]], node_map[lo[cross]]] = True
    late, feeds = np.zeros(shape), np.full(shape, -1, dtype=np.int64)
    dense = np.array([layer.kind == "dense" for layer in graph.spec.layers])
    for w in range(workers):
        mine = node_map[lo] == w
        lo_w, hi_w, out_w = lo[mine], hi[mine], cross[mine]
        for top in np.flatnonzero(sends[:, w])[::-1]:
            want = np.zeros(graph.num_vertices, dtype=bool)
            want[lo_w[out_w & (graph.layer_of[hi_w] == top)]] = True
            chain, layer = [], top - 1
            while layer >= 0 and want.any() and not dense[layer] and not receives[layer, w]:
                early = float(graph.units[want].sum())
                if early >= total[layer, w] or feeds[layer, w] >= 0:
                    break
                chain.append((layer, 1.0 - early / total[layer, w]))
                if layer == 0 or sends[layer, w]:
                    break
                step = want[hi_w]
                want = np.zeros_like(want)
                want[lo_w[step]] = True
                layer -= 1
            for layer, share in chain:
                late[layer, w], feeds[layer, w] = share, top
    return late, feeds


@given(
    st.one_of(small_specs(), chain_specs()),
    st.integers(1, 6),
    st.sampled_from(["metis", "tiles", "random", "stripe", "spatial"]),
    st.sampled_from([8, 64, 256]),
)
@settings(max_examples=80, deadline=None)
def test_vectorised_shares_equal_the_loops(spec, workers, method, blocks):
    grain = Granularity(spatial_blocks=blocks, dense_blocks=4)
    p = plan(spec, workers, method, granularity=grain)
    graph = build_unit_graph(spec, p.granularity)
    late, feeds = chain_shares(graph, p.node_map, workers)
    want_late, want_feeds = _chains_loop(graph, p.node_map, workers)
    assert np.array_equal(feeds, want_feeds)
    assert np.allclose(late, want_late, rtol=0, atol=1e-12)
    got = interior_shares(graph, p.node_map, workers)
    assert np.allclose(got, _interior_loop(graph, p.node_map, workers), rtol=0, atol=1e-12)
