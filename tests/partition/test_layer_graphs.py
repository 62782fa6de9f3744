"""Planning layer graphs: the unit graph's skip edges and multi-source reads, exact traffic on
random branching specs, METIS's stacks, the zoo's ResNets (every method's plan of a layer
graph against its bound: tests/partition/test_volume.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.models import ZOO
from netpart.partition import METHODS as ALL_METHODS
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.stacks import stack_graph
from netpart.partition.volume import layer_traffic
from tests.conftest import brute_force_volume, graph_specs, reads

METHODS = sorted(ALL_METHODS)
FINE = Granularity(spatial_blocks=12, dense_blocks=3)


@given(graph_specs(), st.integers(1, 4), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_traffic_of_a_layer_graph_equals_a_unit_level_recount(spec, workers, seed):
    g = build_unit_graph(spec, FINE)
    node_map = np.random.default_rng(seed).integers(0, workers, g.num_vertices)
    assert layer_traffic(g, node_map, workers).sum(axis=(1, 2)).tolist() == brute_force_volume(
        g, node_map
    )


@given(graph_specs(), st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_the_read_edges_join_every_source_a_layer_reads(spec, workers):
    """Each edge's weight is the units a reader block reads of a source block, recounted
    unit by unit over every input of the reader's layer; the adjacency is symmetric."""
    g = build_unit_graph(spec, FINE)
    want: dict[tuple[int, int], int] = {}
    for i in range(len(spec.layers)):
        block_of = _blocks(g, i)
        for slot, source in enumerate(spec.sources(i)):
            if source < 0:
                continue
            src_block = _blocks(g, source)
            seen: dict[tuple[int, int], set] = {}
            for unit, b in block_of.items():
                for u in reads(spec, i, unit, slot):
                    seen.setdefault((b, src_block[u]), set()).add((slot, u))
            for key, units in seen.items():
                # x + x reads each unit once per input; a concat's inputs are apart
                want[key] = want.get(key, 0) + len(units)
    rd, sr, wt = g.reads
    got = {(int(a), int(b)): int(c) for a, b, c in zip(rd, sr, wt, strict=True)}
    assert got == want
    n = g.num_vertices
    dense = np.zeros((n, n), dtype=np.int64)
    rows = np.repeat(np.arange(n), np.diff(g.xadj))
    dense[rows, g.adjncy] = g.adjwgt
    assert np.array_equal(dense, dense.T)
    for v in range(n):
        row = g.adjncy[g.xadj[v] : g.xadj[v + 1]]
        assert np.all(np.diff(row) > 0)


def _blocks(g, index):
    """The block of every unit (c, y, x) of layer `index`."""
    lb = g.layers[index]
    out = {}
    for b in range(lb.first, lb.first + lb.count):
        c0, c1, y0, y1, x0, x1 = g.box[b]
        for c in range(c0, c1):
            for y in range(y0, y1):
                for x in range(x0, x1):
                    out[(c, y, x)] = b
    return out


def test_metis_cuts_the_layers_of_one_grid_alike():
    """The stacked graph: one vertex per place of a grid, weighing every layer of that grid
    there; its edges are the reads between places, both ways; METIS's cut of it gives each
    layer of a stack the same owners."""
    spec = ZOO["resnet-20"]
    g = build_unit_graph(spec, Granularity.for_workers(4))
    stacks = stack_graph(g)
    assert stacks.vwgt.sum() == g.flops.sum()
    assert stacks.vsize.sum() == g.units.sum()
    n = len(stacks.vsize)
    rows = np.repeat(np.arange(n), np.diff(stacks.xadj))
    ends = zip(rows.tolist(), stacks.adjncy.tolist(), strict=True)
    pairs = dict(zip(ends, stacks.adjwgt.tolist(), strict=True))
    assert all(pairs[(b, a)] == w for (a, b), w in pairs.items())
    rd, sr, wt = g.reads
    crossing = stacks.of[rd] != stacks.of[sr]
    assert stacks.adjwgt.sum() == 2 * wt[crossing].sum()
    p = plan(spec, 4, "metis")
    first = [lb for lb in g.layers if lb.shape == g.layers[2].shape]
    maps = [p.node_map[lb.ids] for lb in first]
    same = np.mean([np.mean(m == maps[0]) for m in maps])
    assert same > 0.9  # the balance repair may move a few blocks of a layer


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("method", ["metis", "tiles"])
def test_resnet_20_plans_within_its_bound(workers, method):
    p = plan(ZOO["resnet-20"], workers, method)
    assert p.metrics.lower_bound <= p.metrics.volume
    assert p.metrics.max_layer_imbalance <= 1.25
    g = build_unit_graph(ZOO["resnet-20"], p.granularity)
    assert p.metrics.volume == int(layer_traffic(g, p.node_map, workers).sum())


def test_a_layer_graph_s_prediction_hides_no_halo():
    """The runtime splits no layer of a layer graph (nor runs producer chains in it): its
    prediction on machines of their own hides nothing, and its report splits nothing."""
    from dataclasses import replace

    from netpart.cost.machine import Machine

    spec = ZOO["resnet-20"]
    alone = plan(spec, 4, "tiles", network=replace(Machine(), overlap=True))
    shared = plan(spec, 4, "tiles", network=replace(Machine(), overlap=False))
    assert not any(layer.split for layer in alone.layers)
    assert alone.metrics.predicted_step_s == pytest.approx(shared.metrics.predicted_step_s)


def test_a_batch_norm_s_collectives_are_priced():
    """Each batch norm's all-reduce of its channels' sums, among the replica's workers, once
    forward and once backward: its layer's exchange and the step (none on one worker)."""
    import numpy as np

    from netpart.cost.step import step_times

    spec = ZOO["resnet-20"]
    p = plan(spec, 2, "tiles")
    for i, (layer, figures) in enumerate(zip(spec.layers, p.layers, strict=True)):
        if layer.kind == "batchnorm":
            want = 2 * p.network.allreduce_s(4 * spec.shapes[i].channels, 2)
            assert figures.volume == 0 and figures.exchange_s == pytest.approx(want)
    assert p.network.allreduce_s(4 * 16, 1) == 0.0
    flops, traffic = np.ones((3, 2)), np.zeros((3, 2, 2), dtype=np.int64)
    _, _, alone = step_times(flops, traffic, 1, p.network)
    _, exchange, joined = step_times(flops, traffic, 1, p.network, collectives=[0, 0.5, 0])
    assert joined == pytest.approx(alone + 1.0) and exchange.tolist() == [0, 1.0, 0]
