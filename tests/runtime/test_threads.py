"""The central invariant: a partitioned step equals the single-process reference (float64).

Workers run as threads over the in-process transport here, so hypothesis can try many specs
and plans; tests/test_runtime_processes.py runs the same worker code over gloo in processes.
"""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from netpart.compile.schedule import build_schedule, plan_schedule
from netpart.compile.shards import ShardLayout
from netpart.errors import ScheduleError, ShapeMismatchError
from netpart.models import ZOO, build_reference
from netpart.models.dropout import training_key
from netpart.models.spec import ModelSpec
from netpart.partition import METHODS as ALL_METHODS
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.evaluate import evaluate
from netpart.partition.rectangles import plane_rectangles
from netpart.runtime.check import make_batch
from netpart.runtime.inprocess import ThreadTransport, run_step_threads
from netpart.runtime.worker import ModelWorker
from tests.conftest import chain_specs, small_specs

METHODS = sorted(ALL_METHODS)  # every partitioner, new ones included


def reference_step(spec, inputs, targets, seed=0, dropout=None):
    model = build_reference(spec, seed, torch.float64)
    out = model(inputs, dropout)
    loss = model.loss(out, targets)
    if loss.requires_grad:  # a spec of pool/lcn layers only has no parameters
        loss.backward()
    return float(loss.detach()), out.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_equal_to_reference(spec, result, inputs, targets, dropout=None):
    loss, out, grads = reference_step(spec, inputs, targets, dropout=dropout)
    scale = max(1.0, abs(loss))
    assert abs(result.loss - loss) <= 1e-9 * scale
    assert torch.allclose(result.outputs.reshape(out.shape), out, rtol=1e-9, atol=1e-9)
    for name, g in grads.items():
        assert torch.allclose(result.grads[name], g, rtol=1e-9, atol=1e-9), name
    if spec.loss == "cross_entropy":  # correct: the target's logit is the largest
        flat = out.reshape(out.shape[0], -1)
        want = (flat.gather(1, targets[:, None])[:, 0] >= flat.max(1).values).double().mean()
        assert result.accuracy == pytest.approx(float(want), abs=1e-12)
    else:
        assert result.accuracy is None


@given(
    small_specs(),
    st.integers(1, 4),
    st.sampled_from(METHODS),
    st.integers(1, 3),
    st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None)
def test_partitioned_step_equals_reference(spec, workers, method, batch, seed):
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    x, y = make_batch(spec, batch, seed)
    key = training_key(spec, seed, step=seed % 7 + 1, first_sample=seed % 3 * batch)
    result = run_step_threads(spec, p, x, y, dropout=key)
    assert_equal_to_reference(spec, result, x, y, key)  # dropout's masks too, whatever the plan
    # Bytes moved equal the plan's volume: per layer, per direction, per worker.
    graph = build_unit_graph(spec, p.granularity)
    traffic = build_schedule(graph, p.node_map, workers).traffic() * batch * 8
    for w in range(workers):
        for layer in range(1, len(spec.layers)):
            assert result.sent[w].get((layer, "forward"), 0) == traffic[layer, w].sum()
            assert result.received[w].get((layer, "forward"), 0) == traffic[layer, :, w].sum()
            assert result.sent[w].get((layer, "backward"), 0) == traffic[layer, :, w].sum()
            assert result.received[w].get((layer, "backward"), 0) == traffic[layer, w].sum()
    assert sum(ly.volume for ly in p.layers) * batch * 8 == sum(
        sum(v for (_, phase), v in s.items() if phase == "forward") for s in result.sent
    )


@given(
    small_specs(),
    st.integers(2, 4),
    st.sampled_from(METHODS),
    st.integers(1, 3),
    st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_every_split_of_the_program_equals_the_reference(spec, workers, method, batch, overlap):
    """Programs that split every layer they can (interior/boundary forward, input/weights
    backward) and join the rest, and programs that never do: the same step, exactly."""
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    x, y = make_batch(spec, batch, 7)
    key = training_key(spec, 7, 1)
    result = run_step_threads(
        spec, p, x, y, overlap=overlap, split_min_flops=0.0, split=(), dropout=key
    )
    assert_equal_to_reference(spec, result, x, y, key)


@given(
    chain_specs(),
    st.integers(2, 4),
    st.sampled_from(["tiles", "metis", "stripe"]),
    st.booleans(),
    st.integers(1, 3),
    st.sampled_from([8, 64]),  # 64: channel groups, split between workers
)
@settings(max_examples=30, deadline=None)
def test_producer_chains_equal_the_reference(spec, workers, method, aligned, batch, blocks):
    """Programs whose workers compute the units their peers read first (over several layers),
    post them, then the rest, and backward the rest before the peers' gradients arrive: the
    same step, exactly, and the plan's bytes."""
    grain = Granularity(spatial_blocks=blocks, dense_blocks=4, align_pools=aligned)
    p = plan(spec, workers, method, granularity=grain)
    _, schedule = plan_schedule(spec, p, split_min_flops=0.0, split=())
    assume(any(schedule.chains))
    x, y = make_batch(spec, batch, 3)
    key = training_key(spec, 3, 2)  # a chain's early and late parts drop as the reference
    result = run_step_threads(spec, p, x, y, split_min_flops=0.0, split=(), dropout=key)
    assert_equal_to_reference(spec, result, x, y, key)
    traffic = schedule.traffic() * batch * 8
    for w in range(workers):
        for layer in range(1, len(spec.layers)):
            assert result.sent[w].get((layer, "forward"), 0) == traffic[layer, w].sum()
            assert result.sent[w].get((layer, "backward"), 0) == traffic[layer, :, w].sum()


def test_max_pool_ties_send_the_gradient_where_torch_does():
    """A 1x1 LCN of one channel outputs zeros, so every max-pool window is a tie: the first
    position of the window takes the gradient, as in torch's max_pool2d (found by
    hypothesis: a shared gradient differed by 0.2)."""
    spec = ModelSpec.from_json(
        '{"name": "ties", "input": {"channels": 1, "height": 5, "width": 5}, "layers": ['
        '{"kind": "lcn", "kernel": 1, "eps": 0.01},'
        '{"kind": "local", "channels": 1, "kernel": 1, "activation": "tanh"},'
        '{"kind": "pool", "kernel": 2, "stride": 1, "mode": "max"}]}'
    )
    for method in ("layers", "metis"):
        p = plan(spec, 2, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
        x, y = make_batch(spec, 2, 7)
        assert_equal_to_reference(spec, run_step_threads(spec, p, x, y), x, y)


@pytest.mark.parametrize(("name", "workers"), [("tiny-local", 4), ("tiny-mlp", 3)])
def test_zoo_models_at_default_granularity(name, workers):
    spec = ZOO[name]
    x, y = make_batch(spec, 5, 1)
    assert_equal_to_reference(spec, run_step_threads(spec, plan(spec, workers), x, y), x, y)


def test_validator_rejects_a_corrupted_plan():
    spec = ZOO["tiny-local"]
    p = plan(spec, 3)
    graph = build_unit_graph(spec, p.granularity)
    build_schedule(graph, p.node_map, 3).validate(p)  # the real plan passes
    corrupted = p.node_map.copy()
    corrupted[: len(corrupted) // 2] = (corrupted[: len(corrupted) // 2] + 1) % 3
    with pytest.raises(ShapeMismatchError, match="do not belong together"):
        build_schedule(graph, corrupted, 3).validate(p)


def test_validator_rejects_unpaired_and_mismatched_messages():
    spec = ZOO["tiny-local"]
    p = plan(spec, 2)
    sched = build_schedule(build_unit_graph(spec, p.granularity), p.node_map, 2)
    layer = next(i for i, m in enumerate(sched.sends) if m)
    key = next(iter(sched.sends[layer]))
    stolen = dict(sched.sends[layer])
    stolen[key] = np.concatenate([stolen[key], stolen[key][:1]])  # a unit twice: not owned twice
    bad = type(sched)(
        sched.workers, sched.owned, (*sched.sends[:layer], stolen, *sched.sends[layer + 1 :])
    )
    bad.validate()  # still self-consistent: both sides derive from one list
    with pytest.raises(ShapeMismatchError):
        bad.validate(p)
    wrong_owner = dict(sched.sends[layer])
    d = key[1]
    wrong_owner[key] = sched.owned[layer - 1][d][:1]  # d's own unit, "sent" by key[0]
    bad = type(sched)(
        sched.workers, sched.owned, (*sched.sends[:layer], wrong_owner, *sched.sends[layer + 1 :])
    )
    with pytest.raises(ScheduleError, match="does not own"):
        bad.validate()


def test_bound_gradients_are_the_collected_ones_in_layout_order():
    """Backward accumulates into one flat buffer in the shard layout's piece order (what a
    push sends), also for locally connected slices whose runs are separate leaves."""
    spec = ZOO["tiny-local"]
    p = plan(spec, 2, "tiles")
    graph, schedule = plan_schedule(spec, p, split_min_flops=0.0, split=())  # split all it can
    x, y = make_batch(spec, 3, 2)
    transports = ThreadTransport.group(2)
    flats, collected = [None, None], [None, None]

    def work(rank):
        worker = ModelWorker(spec, graph, schedule, rank, seed=0, dtype=torch.float64)
        flat = torch.zeros(sum(t.numel() for t in worker.param_tensors()), dtype=torch.float64)
        worker.bind_grads(flat)
        for _ in range(2):  # gradients of two steps accumulate
            worker.step(x, y, transports[rank], collect_grads=False)
        flats[rank] = flat
        collected[rank] = torch.cat([g.reshape(-1) for _, _, g in worker.collect_grads()])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(2):
        assert flats[rank].abs().sum() > 0 and torch.equal(flats[rank], collected[rank])
        layout = ShardLayout.build(graph, p.node_map, 2, 2)
        assert flats[rank].numel() == layout.worker_size(rank)


def test_a_chain_through_a_channel_wise_reader_equals_the_reference():
    """Found by the test above: a pool reads one channel per unit, so the units a peer reads
    of the conv below were some channels of a position; the conv's slice computes a
    position's channels together (the chain's early units now hold them all)."""
    spec = ModelSpec.from_dict(
        {
            "name": "random",
            "input": {"channels": 2, "height": 7, "width": 10},
            "layers": [
                {"kind": "conv", "channels": 3, "kernel": 3, "stride": 2, "activation": "tanh"},
                {"kind": "pool", "mode": "l2", "kernel": 2, "stride": 1},
                {"kind": "local", "channels": 2, "kernel": 1, "stride": 1},
                {"kind": "dense", "units": 1, "activation": "tanh"},
            ],
        }
    )
    p = plan(spec, 4, "metis", granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    x, y = make_batch(spec, 3, 7)
    result = run_step_threads(spec, p, x, y, overlap=True, split_min_flops=0.0, split=())
    assert_equal_to_reference(spec, result, x, y)


@given(
    small_specs(),
    st.integers(1, 4),
    st.sampled_from(["metis", "tiles", "stripe"]),
    st.integers(1, 3),
    st.integers(0, 1000),
)
@settings(max_examples=30, deadline=None)
def test_a_forward_only_evaluation_equals_the_reference_and_leaves_no_gradient(
    spec, workers, method, batch, seed
):
    """Held-out evaluation during training: the replica's workers run only the forward
    instructions and the loss; loss and accuracy are the reference's, no parameter gets a
    gradient, and a training step after it is still the reference's."""
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    graph, schedule = plan_schedule(spec, p)
    x, y = make_batch(spec, batch, seed)
    transports = ThreadTransport.group(workers)
    got: list = [None] * workers
    errors: list = []

    def work(rank: int) -> None:
        try:
            worker = ModelWorker(spec, graph, schedule, rank, dtype=torch.float64)
            got[rank] = worker.evaluate(x, y, transports[rank])
            assert all(q.grad is None or not q.grad.any() for q in worker.parameters())
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            transports[rank].fail()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    loss, out, _ = reference_step(spec, x, y)
    for rank_loss, accuracy in got:
        assert abs(rank_loss - loss) <= 1e-9 * max(1.0, abs(loss))
        if spec.loss == "cross_entropy":
            flat = out.reshape(out.shape[0], -1)
            want = (flat.gather(1, y[:, None])[:, 0] >= flat.max(1).values).double().mean()
            assert accuracy == pytest.approx(float(want), abs=1e-12)


@given(
    chain_specs(),
    st.integers(2, 3),
    st.sampled_from(["tiles", "metis"]),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.integers(1, 3),
)
@settings(max_examples=25, deadline=None)
def test_any_choice_of_splits_equals_the_reference(spec, workers, method, choice, batch):
    """Whatever layers a plan splits, the step is the reference's (float64, 1e-9)."""
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    x, y = make_batch(spec, batch, 5)
    split = tuple(choice[: len(spec.layers)])
    result = run_step_threads(spec, p, x, y, split_min_flops=0.0, split=split)
    assert_equal_to_reference(spec, result, x, y)


def test_a_conv_run_that_is_a_rectangle_runs_torch_s_convolution_and_others_gather():
    """Tiles give every worker (nearly) a rectangle of each conv layer's plane: torch's
    convolution computes it (halo, stride and zero padding read through the input box); what
    no rectangle of 16 positions holds (units a balanced cut moved, an irregular cut) is
    gathered as patches. Both equal the reference."""
    layers = [
        {"kind": "conv", "channels": 3, "kernel": 3, "stride": 1, "padding": 1},
        {"kind": "conv", "channels": 2, "kernel": 3, "stride": 2, "padding": 1},
        {"kind": "dense", "units": 3, "activation": "softmax"},
    ]
    spec = ModelSpec.from_dict(
        {"name": "c", "input": {"channels": 2, "height": 11, "width": 9}, "layer": layers}
    )
    x, y = make_batch(spec, 3, seed=4)
    shares = {}
    for method, workers in (("tiles", 4), ("tiles", 1), ("random", 3), ("metis", 3)):
        p = plan(spec, workers, method)
        graph, schedule = plan_schedule(spec, p)
        convs = [ModelWorker(spec, graph, schedule, w).slices[0] for w in range(workers)]
        shares[(method, workers)] = [c.convolved() for c in convs if len(c.units)]
        # the plan's report states the same share (`netpart.partition.rectangles`)
        done = sum(c.convolved() * len(c.units) for c in convs if len(c.units))
        assert p.layers[0].convolved == pytest.approx(done / spec.shapes[0].size, abs=1e-12)
        assert_equal_to_reference(spec, run_step_threads(spec, p, x, y), x, y)
    assert shares[("tiles", 1)] == [1.0]
    # 4 tiles of an 11x9 plane, balanced to a unit: rectangles but for a few moved units
    assert min(shares[("tiles", 4)]) >= 0.75
    assert max(shares[("random", 3)]) == 0.0  # a random cut leaves no rectangle of 16


@pytest.mark.parametrize("kinds", [("conv", "pool"), ("lcn", "conv")])
def test_a_worker_holding_a_whole_layer_runs_it_on_planes(kinds):
    """A conv, pool or LCN layer one worker holds whole runs as the plain module runs it, on
    [B, C, H, W] planes: read from the input buffer where the layer below is split (its halo
    received), from the planes of a whole layer below without a copy. Equal to the reference,
    with dropout on, and the bytes the plan moves."""
    first = {
        "conv": {"kind": "conv", "channels": 3, "kernel": [3, 2], "padding": [1, 0]},
        "lcn": {"kind": "lcn", "kernel": 3},
    }[kinds[0]]
    second = {
        "conv": {"kind": "conv", "channels": 2, "kernel": 3, "stride": 2, "dropout": 0.3},
        "pool": {"kind": "pool", "kernel": 2, "mode": "max", "dropout": 0.3},
    }[kinds[1]]
    layers = [first, second, {"kind": "dense", "units": 3, "activation": "softmax"}]
    spec = ModelSpec.from_dict(
        {"name": "w", "input": {"channels": 2, "height": 9, "width": 8}, "layer": layers}
    )
    p = plan(spec, 2, "tiles")
    graph = build_unit_graph(spec, p.granularity)

    def moved(node_map):
        metrics, figures, per_worker = evaluate(graph, node_map, 2, p.batch, p.network)
        return replace(p, node_map=node_map, metrics=metrics, layers=figures, per_worker=per_worker)

    split = moved(np.where(graph.layer_of == 1, 0, p.node_map))  # layer 1 whole, 0 split
    x, y = make_batch(spec, 3, seed=5)
    key = training_key(spec, 5, 1)
    _, schedule = plan_schedule(spec, split)
    planes = [[s.plane for s in ModelWorker(spec, graph, schedule, w).slices] for w in (0, 1)]
    assert planes[0][1] and not planes[0][0] and not any(planes[1])
    result = run_step_threads(spec, split, x, y, dropout=key)
    assert_equal_to_reference(spec, result, x, y, key)
    assert result.received[0][(1, "forward")] > 0  # the halo, read through the planes
    whole = moved(np.where(graph.layer_of <= 1, 0, p.node_map))  # layers 0 and 1 whole
    assert_equal_to_reference(spec, run_step_threads(spec, whole, x, y, dropout=key), x, y, key)


@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**16), st.integers(1, 6))
@settings(max_examples=80, deadline=None)
def test_plane_rectangles_cover_the_positions_once(height, width, seed, least):
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(height * width) < rng.random())
    rects, rest = plane_rectangles(positions, width, least=least)
    covered = [
        (y * width + x) for y0, y1, x0, x1 in rects for y in range(y0, y1) for x in range(x0, x1)
    ]
    assert all((y1 - y0) * (x1 - x0) >= least for y0, y1, x0, x1 in rects)
    assert sorted(covered + positions[rest].tolist()) == positions.tolist()  # each once
