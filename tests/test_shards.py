"""Shard layout, update rules and data sharding: pure, in-process checks."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.data import DataError, load_data
from netpart.models import build_reference, load_spec
from netpart.partition import build_unit_graph, plan
from netpart.partition.methods import METHODS
from netpart.partition.shards import ShardLayout, piece_index, shard_bounds
from netpart.runtime.checkpoint import export_state_dict
from netpart.runtime.config import TrainConfig, TrainError
from netpart.runtime.trainer import initial_values
from netpart.runtime.updates import Optimizer, UpdateRule
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


@pytest.mark.parametrize("name,workers,shards", [("tiny-local", 3, 2), ("tiny-mlp", 2, 3)])
def test_shards_start_from_the_reference_initialisation(name, workers, shards):
    spec = load_spec(name)
    layout = _layout(spec, workers, "metis", shards)
    values = [initial_values(spec, layout, s, 7, torch.float64) for s in range(shards)]
    got = export_state_dict(spec, layout, values)
    want = build_reference(spec, 7, torch.float64).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_adagrad_rule_equals_torch_adagrad():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen, dtype=torch.float64)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(5)]
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.Adagrad([ref], lr=0.1)
    rule = UpdateRule(Optimizer("adagrad", 0.1), start.clone())
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        rule.apply(0, g[:20])  # two segments, as two pushes would
        rule.apply(20, g[20:])
    assert torch.allclose(rule.values, ref.detach(), rtol=0, atol=1e-15)
    assert torch.allclose(rule.state, opt.state[ref]["sum"], rtol=0, atol=1e-15)


def test_sgd_rule():
    rule = UpdateRule(Optimizer("sgd", 0.5), torch.ones(4))
    rule.apply(1, torch.tensor([2.0, 4.0]))
    assert rule.values.tolist() == [1.0, 0.0, -1.0, 1.0] and rule.state is None


def test_replicas_read_disjoint_shards_and_batches_are_pure():
    spec = load_spec("tiny-mlp")
    data = load_data("synthetic", spec, seed=3, examples=100)
    seen = [set(data.indices(r, 3, 1, 33).tolist()) for r in range(3)]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    x1, y1 = data.batch(1, 3, 5, 8, torch.float64)
    x2, y2 = data.batch(1, 3, 5, 8, torch.float64)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    epoch = data.indices(0, 3, 1, 34)
    assert sorted(epoch.tolist()) == list(range(0, 100, 3))  # one epoch = the whole shard


def test_npz_data_is_checked(tmp_path):
    spec = load_spec("tiny-mlp")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((5, 3)), y=np.zeros(5, dtype=np.int64))
    with pytest.raises(DataError, match="needs x"):
        load_data(str(bad), spec)
    with pytest.raises(DataError, match="synthetic"):
        load_data("data.csv", spec)


def test_train_config_round_trip_and_errors():
    cfg = TrainConfig(replicas=3, shards=2, mode="sync", optimizer="sgd", lr=0.2, steps=7)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    for bad, match in (
        ({"replicas": 0}, "--replicas"),
        ({"shards": 0}, "--ps-shards"),
        ({"n_fetch": 0}, "--n-fetch"),
        ({"n_push": 0}, "--n-push"),
        ({"mode": "async"}, "--mode"),
        ({"lr": 0.0}, "--lr"),
        ({"dc_lambda": -1.0}, "--dc-lambda"),
        ({"mode": "sync", "push_norm": 1.0}, "apply to --mode downpour"),
        ({"placement": "random"}, "--placement"),
        ({"snapshot_every": -1}, "--snapshot-every"),
        ({"mode": "sandblaster"}, "goes with --optimizer lbfgs"),
        ({"optimizer": "lbfgs"}, "goes with --optimizer lbfgs"),
        ({"mode": "sandblaster", "optimizer": "lbfgs", "line_search": "wolfe"}, "armijo or none"),
        ({"mode": "sandblaster", "optimizer": "lbfgs", "units": 64, "batch": 32}, "--units 64"),
    ):
        with pytest.raises(TrainError, match=match):
            TrainConfig(**bad)
    with pytest.raises(TrainError, match="unknown"):
        TrainConfig.from_dict({"replica": 2})


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    chunk=st.integers(1, 50),
)
def test_push_chunks_fold_into_exactly_the_segments(lengths, chunk):
    """Every payload value lands once, at its segment's shard offset, whatever the chunking."""
    from netpart.partition.shards import Segment
    from netpart.runtime import ps

    shard_lo = np.cumsum([0] + [n + 3 for n in lengths])[:-1]  # gaps between segments
    segments = tuple(
        Segment(local_lo=0, shard_lo=int(g), length=n)
        for g, n in zip(shard_lo, lengths, strict=True)
    )
    total = sum(lengths)
    old = ps.CHUNK
    ps.CHUNK = chunk
    try:
        chunks = ps._chunks(total)
    finally:
        ps.CHUNK = old
    assert chunks[0][0] == 0 and chunks[-1][1] == total
    assert all(b - a <= chunk for a, b in chunks)
    landed = {}
    for a, b in chunks:
        for lo, hi, at in ps._overlaps(segments, a, b):
            for k in range(hi - lo):
                assert at + k not in landed
                landed[at + k] = lo + k
    want = {
        int(g) + k: off + k
        for g, n, off in zip(shard_lo, lengths, np.cumsum([0, *lengths]), strict=False)
        for k in range(n)
    }
    assert landed == want


def _server(mode, replicas=2, dc_lambda=0.0, lr=1.0):
    from netpart.runtime.ps import ShardServer, ShardState

    layout = _layout(load_spec("tiny-mlp"), 2, "metis", 1)
    values = torch.zeros(layout.total, dtype=torch.float64)
    rule = UpdateRule(Optimizer("sgd", lr), values)
    state = ShardState(values=values, state=None)
    return ShardServer(
        layout, 0, replicas, mode, rule, lambda r, w: r * 2 + w, 4, state, dc_lambda=dc_lambda
    )


def _served(server, replica, worker):
    """What a fetch of (replica, worker) is answered with, remembered as DC-ASGD needs."""
    out, version = server._snapshot_when_ready(replica, 0, server.routes[worker])
    server._remember(replica, worker, version, out)
    return out.clone(), version


def test_dc_asgd_compensates_a_stale_push_with_the_values_it_was_computed_on():
    lam, lr = 0.5, 0.1
    server = _server("downpour", dc_lambda=lam, lr=lr)
    w = server.workers[0]
    segs = server.routes[w]
    n = sum(g.length for g in segs)
    then, v0 = _served(server, 0, w)  # replica 0 fetches (all zeros), version 0
    g1 = torch.linspace(-1, 1, n, dtype=torch.float64)
    _, v1 = _served(server, 1, w)
    server._fold(1, w, 1, g1, segs, version=v1)  # replica 1's fresh push: no correction
    now = then - lr * g1
    assert torch.allclose(_served(server, 1, w)[0], now, atol=1e-15)
    g0 = torch.cos(torch.arange(n, dtype=torch.float64))
    server._fold(0, w, 1, g0, segs, version=v0)  # stale by one update
    want = now - lr * (g0 + lam * g0 * g0 * (now - then))
    assert torch.allclose(_served(server, 0, w)[0], want, atol=1e-15)
    assert server.staleness == {0: 1, 1: 1}
    plain = _server("downpour", lr=lr)  # without compensation: the plain stale gradient
    plain._fold(1, w, 1, g1, segs, version=0)
    plain._fold(0, w, 1, g0, segs, version=0)
    assert torch.allclose(_served(plain, 0, w)[0], now - lr * g0, atol=1e-15)


def test_sync_shard_applies_the_mean_once_every_live_replica_pushed():
    server = _server("sync")
    n = {w: sum(g.length for g in server.routes[w]) for w in server.workers}
    one = {w: torch.ones(n[w], dtype=torch.float64) for w in server.workers}
    for w in server.workers:  # replica 0 pushes step 1: nothing applied yet
        server._fold(0, w, 1, one[w], server.routes[w])
    assert server.state.clock == 0 and not server._ready(0, 1)
    for w in server.workers:
        server._fold(1, w, 1, 3 * one[w], server.routes[w])
    assert server.state.clock == 1 and server._ready(0, 1)
    assert torch.equal(server.rule.values, torch.full_like(server.rule.values, -2.0))  # mean 2
    for w in server.workers:  # step 2: replica 1 is lost mid-step; its push is dropped
        server._fold(1, w, 2, one[w], server.routes[w])
    server.lose(1, "test")
    assert server.state.clock == 1
    for w in server.workers:
        server._fold(0, w, 2, one[w], server.routes[w])
    assert server.state.clock == 2 and server.rule.values[0] == -3.0


def test_downpour_warm_start_waits_for_replica_0():
    server = _server("downpour")
    n = {w: sum(g.length for g in server.routes[w]) for w in server.workers}
    assert server._ready(1, 0) and not server._ready(1, 3)
    for step in (1, 2, 3):
        assert not server._ready(1, 3)
        for w in server.workers:
            server._fold(0, w, step, torch.zeros(n[w], dtype=torch.float64), server.routes[w])
    assert server._ready(1, 3) and server.state.updates == 3 * len(server.workers)


def test_digits_are_resized_standardised_and_hold_out_a_fixed_fifth():
    spec = load_spec("tiny-local")  # 1 x 16 x 16 input, 10 classes
    data = load_data("digits", spec, seed=1)
    x_test, y_test = data.held_out
    assert data.x.shape == (1438, 256) and x_test.shape == (359, 256)
    assert abs(float(np.concatenate([data.x, x_test]).mean())) < 1e-5
    assert set(np.unique(y_test)) == set(range(10))
    again = load_data("digits", spec, seed=2)  # the split does not depend on the seed
    assert np.array_equal(again.held_out[1], y_test)
    train_rows = {r.tobytes() for r in data.x}
    assert not any(r.tobytes() in train_rows for r in x_test)  # no example on both sides
    assert load_data("digits", load_spec("tiny-mlp")).x.shape[1] == 64  # flat 64 features
    with pytest.raises(DataError, match="takes 440 features, not 64"):
        load_data("digits", load_spec("speech"))
