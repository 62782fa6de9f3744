import numpy as np
import pytest

from netpart.errors import MetisError
from netpart.partition.metis import metis_available, part_graph


def _two_layer_chain(n: int = 8):
    """Two paths of n vertices (layer 0 and layer 1), vertex i joined to i+n."""
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(n + i, n + i + 1) for i in range(n - 1)] + [(i, i + n) for i in range(n)]
    adj = [[] for _ in range(2 * n)]
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    xadj = np.concatenate([[0], np.cumsum([len(a) for a in adj])])
    return xadj, np.array([x for a in adj for x in a])


def test_capability_is_probed():
    ok, why = metis_available()
    assert ok, why


def test_two_constraints_balance_each_layer():
    # Layer 0 is 9x heavier than layer 1: one constraint may put all of layer 1 on one side.
    n = 8
    xadj, adjncy = _two_layer_chain(n)
    single = np.concatenate([np.full(n, 9), np.full(n, 1)])[:, None]
    multi = np.zeros((2 * n, 2), dtype=np.int64)
    multi[:n, 0], multi[n:, 1] = 9, 1
    for algorithm, objective in (("kway", "vol"), ("kway", "cut"), ("recursive", "cut")):
        parts = part_graph(
            xadj,
            adjncy,
            multi,
            2,
            ubvec=np.array([1.01, 1.01]),
            algorithm=algorithm,
            objective=objective,
        ).parts
        for layer in (parts[:n], parts[n:]):
            assert np.bincount(layer, minlength=2).tolist() == [n // 2, n // 2]
    assert part_graph(xadj, adjncy, single, 2).parts.shape == (2 * n,)


def test_capacities_shift_load():
    n = 40
    xadj, adjncy = _two_layer_chain(n)
    w = np.ones((2 * n, 1), dtype=np.int64)
    tp = np.array([[0.25], [0.75]])
    parts = part_graph(xadj, adjncy, w, 2, tpwgts=tp, ubvec=np.array([1.05])).parts
    assert abs(np.bincount(parts, minlength=2)[1] - 60) <= 4


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x, a, w: (x, np.concatenate([a[:-1], [a[-1] ^ 1]]), w), "symmetric|self loops"),
        (lambda x, a, w: (x, a, w * 0), "positive weight"),
        (lambda x, a, w: (x, a, w[:-1]), r"vertex weights must be \[16"),
        (lambda x, a, w: (x[:-1], a, w), "xadj"),
        (lambda x, a, w: (x, np.where(a == 3, 99, a), w), "outside"),
    ],
)
def test_invalid_graphs_are_rejected_before_metis_sees_them(mutate, message):
    xadj, adjncy = _two_layer_chain()
    w = np.ones((16, 1), dtype=np.int64)
    x, a, ww = mutate(xadj, adjncy, w)
    with pytest.raises(MetisError, match=message):
        part_graph(x, a, ww, 2)


def test_bad_options_are_rejected():
    xadj, adjncy = _two_layer_chain()
    w = np.ones((16, 1), dtype=np.int64)
    with pytest.raises(MetisError, match="ubvec"):
        part_graph(xadj, adjncy, w, 2, ubvec=np.array([0.9]))
    with pytest.raises(MetisError, match="tpwgts"):
        part_graph(xadj, adjncy, w, 2, tpwgts=np.array([1.0]))
    with pytest.raises(MetisError, match="edge cut only"):
        part_graph(xadj, adjncy, w, 2, algorithm="recursive", objective="vol")


def test_a_sorted_graph_with_unequal_weights_or_a_missing_reverse_is_refused():
    """Rows ascending take the one-sort check: it still sees a weight that differs between
    the two directions of an edge, and an edge without its reverse."""
    xadj, adjncy = _two_layer_chain()
    src = np.repeat(np.arange(16), np.diff(xadj))
    adjncy = adjncy[np.lexsort((adjncy, src))]  # each row ascending
    w = np.ones((16, 1), dtype=np.int64)
    assert np.all(np.diff(src * 16 + adjncy) > 0)  # the fast path's precondition
    weights = np.ones(len(adjncy), dtype=np.int64)
    part_graph(xadj, adjncy, w, 2, adjwgt=weights)  # symmetric: accepted
    weights[0] = 2
    with pytest.raises(MetisError, match=r"symmetric|weights differ"):
        part_graph(xadj, adjncy, w, 2, adjwgt=weights)
    shifted = adjncy.copy()
    shifted[0] = (adjncy[0] + 2) % 16 or 1  # u->v' without v'->u
    with pytest.raises(MetisError, match=r"symmetric|self loops"):
        part_graph(xadj, shifted, w, 2)
