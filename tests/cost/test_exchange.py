"""The parameter server's measured exchange: its tables round-trip through JSON (alone and in
a profile's model), read as the module says (more clients than measured: the same bytes
through the shard), are refused in one line when malformed, and price a layout as
`planning.cluster` says: sync = step + exchange; Downpour = the longer of the exchange and
the step (on a share of a core, its CPU over the share) plus the time it keeps the worker's
machine busy."""

import json
from dataclasses import replace

import pytest

from netpart.cost.exchange import PsExchange
from netpart.cost.machine import Machine
from netpart.cost.tables import KindCost
from netpart.errors import PlanError
from netpart.models import load_spec
from netpart.partition.planner import plan
from netpart.planning.cluster import (
    LOOP_CPU_S,
    LOOP_DENSE_SLICES,
    UPDATE_S_PER_VALUE,
    advise,
    loop_cpu_s,
)

SIZES = [1e3, 1e4, 1e5, 1e6]


def tables(sync_s=1e-8, down_s=1e-8, busy_s=5e-9) -> PsExchange:
    """Seconds linear in bytes: per byte `sync_s` (x clients), `down_s`, busy `busy_s`."""
    per = {"sync": sync_s, "downpour": down_s}
    seconds = {m: {str(k): [k * s * b for b in SIZES] for k in (1, 2)} for m, s in per.items()}
    busy = {m: {str(k): [busy_s * b for b in SIZES] for k in (1, 2)} for m in per}
    return PsExchange.from_dict({"sizes": SIZES, "seconds": seconds, "busy": busy})


def test_the_tables_round_trip_and_read_beyond_what_was_measured():
    ps = tables()
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.seconds_s("sync", 1, 5e4) == pytest.approx(5e-4)
    assert ps.seconds_s("sync", 2, 5e4) == pytest.approx(1e-3)
    # 4 clients: the bytes of 4 through the shard, read off the 2 clients' table
    assert ps.seconds_s("sync", 4, 5e4) == pytest.approx(ps.seconds_s("sync", 2, 1e5))
    assert ps.busy_s("downpour", 1e5) == pytest.approx(5e-4)
    model = Machine(kinds={}, profile="p.json", ps=ps)
    again = Machine.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.ps == ps and again == model
    assert "the parameter server's exchange measured" in model.describe()
    assert model.faster(8).ps is None and model.faster(1).ps == ps  # other machines' CPU
    assert Machine.from_dict({**model.to_dict(), "ps": None}).ps is None


def test_the_all_reduce_alone_is_read_off_its_table_and_a_layout_s_ring_costs_that_and_its_cpu():
    ring = {str(m): [2 * (m - 1) * (1e-3 + b / m * 1e-8) for b in SIZES] for m in (2, 3)}
    ps = PsExchange.from_dict(
        {
            **tables().to_dict(),
            "allreduce": ring,
            "allreduce_busy": {"2": [1e-9 * b for b in SIZES]},
        }
    )
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.allreduce_s(3, 1e5) == pytest.approx(4 * (1e-3 + 1e5 / 3 * 1e-8))
    assert ps.allreduce_s(2, 1e5, busy=True) == pytest.approx(1e-4)
    # 5 machines, 3 measured: 8 phases, each of a fifth of the bytes (the ring's own rule)
    assert ps.allreduce_s(5, 1e5) == pytest.approx(8 * (1e-3 + 1e5 / 5 * 1e-8))
    assert tables().allreduce_s(3, 1e5) == 0.0 and ps.allreduce_s(1, 1e5) == 0.0
    with pytest.raises(ValueError, match="allreduce"):
        PsExchange.from_dict({**tables().to_dict(), "allreduce": {"1": [1, 2, 3, 4]}})
    spec = load_spec("tiny-mlp")
    model = Machine(kinds={}, profile="p.json", ps=ps)
    assert "the parameter server's exchange and the all-reduce measured" in model.describe()
    one = plan(spec, 1, seed=0, batch=32, network=model).metrics.predicted_step_s
    values = spec.num_params
    update = values * UPDATE_S_PER_VALUE  # a whole core
    # the ring alone and the time its CPU keeps a machine busy, which a step leaves no wait
    # on the link to hide in
    measured = ps.allreduce_s(3, 4.0 * values) + ps.allreduce_s(3, 4.0 * values, busy=True)
    assert measured > ps.allreduce_s(3, 4.0 * values)
    for link in (10e-6, 5e-3):  # the ring alone is measured slower, then faster, than priced
        model = replace(model, latency_s=link)
        row = next(f for f in advise(spec, 3, model).layouts if f.layout.mode == "allreduce")
        link_priced = replace(model, ps=None).allreduce_s(values, 3)
        ring = max(measured, link_priced)
        assert model.allreduce_s(values, 3) == pytest.approx(ring)  # the one price
        assert row.step_s == pytest.approx(one + ring + update)
        assert (ring == link_priced) == (link == 5e-3)


def test_a_ring_that_runs_faster_at_a_larger_size_as_a_rule_prices_smaller_ones_at_their_mean():
    # the shape 6 testbed machines at 0.3 core measured in every profile (docs/planning.md,
    # "How to spend M machines"): slower at the small sizes than at the largest; the
    # exchange tables' rule (the fastest larger size) would price the smaller sizes at it
    times = [0.030, 0.026, 0.028, 0.016]
    ps = PsExchange.from_dict({**tables().to_dict(), "allreduce": {"6": times}})
    pooled = sum(times) / len(times)  # the run that falls, pooled into its mean
    for size in (1e3, 5e4, 1e6):
        assert ps.allreduce_s(6, size) == pytest.approx(pooled)
    assert ps.allreduce_s(6, 1e4) > min(times)  # not the lower envelope
    rising = PsExchange.from_dict(
        {**tables().to_dict(), "allreduce": {"6": [1e-3, 2e-3, 4e-3, 8e-3]}}
    )
    assert rising.allreduce_s(6, 1e4) == pytest.approx(2e-3)  # a rising table as measured
    # the exchange's tables keep their rule: a slow small size is an outlier
    seconds = {m: {"1": times} for m in ("sync", "downpour")}
    exchange = PsExchange.from_dict({**tables().to_dict(), "seconds": seconds})
    assert exchange.seconds_s("sync", 1, 1e3) == pytest.approx(min(times))


def test_on_a_quota_each_of_the_ring_s_phases_costs_at_least_a_period():
    ring = {str(m): [2 * (m - 1) * (1e-3 + b / m * 1e-8) for b in SIZES] for m in (2, 3)}
    quota = {**tables().to_dict(), "allreduce": ring, "share": 0.25, "quota_s": 1e-3}
    ps = PsExchange.from_dict(quota)
    assert ps.period_s == pytest.approx(4e-3)  # 1 ms of CPU a period, a quarter of a core
    assert tables().period_s == 0.0  # no quota
    spec = load_spec("tiny-mlp")
    values = spec.num_params
    model = Machine(kinds={}, profile="p.json", ps=ps, latency_s=10e-6)
    one = plan(spec, 1, seed=0, batch=32, network=model).metrics.predicted_step_s
    row = next(f for f in advise(spec, 3, model).layouts if f.layout.mode == "allreduce")
    update = values * UPDATE_S_PER_VALUE / 0.25
    assert row.step_s == pytest.approx(one + 4 * 4e-3 + update)  # 2(M-1) periods
    # a ring measured slower than that stays its own price
    slow = {**quota, "allreduce": {k: [10 * t for t in v] for k, v in ring.items()}}
    model = replace(model, ps=PsExchange.from_dict(slow))
    row = next(f for f in advise(spec, 3, model).layouts if f.layout.mode == "allreduce")
    alone = model.ps.allreduce_s(3, 4.0 * values)
    assert alone > 16e-3 and row.step_s == pytest.approx(one + alone + update)


def test_a_ddp_replica_s_step_timed_by_calibration_prices_the_all_reduce_replica():
    ring = {str(m): [2 * (m - 1) * (1e-3 + b / m * 1e-8) for b in SIZES] for m in (2, 3)}
    timed = {"batch": 32, "seconds": {"tiny-mlp": 0.05}, "cpu_s": {"tiny-mlp": 0.01}}
    ps = PsExchange.from_dict({**tables().to_dict(), "allreduce": ring, "replica": timed})
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.replica_s("tiny-mlp") == 0.05 and ps.replica_s("digits-mlp") is None
    model = Machine(kinds={}, profile="p.json", ps=ps, latency_s=10e-6)
    assert "DDP's replica step of tiny-mlp" in model.describe()
    values = load_spec("tiny-mlp").num_params
    ring_3 = max(ps.allreduce_s(3, 4.0 * values), replace(model, ps=None).allreduce_s(values, 3))

    def replica_s(name: str, batch: int) -> float:
        rows = advise(load_spec(name), 3, model, batch=batch).layouts
        return next(f for f in rows if f.layout.mode == "allreduce").step_s - ring_3

    assert replica_s("tiny-mlp", 32) == pytest.approx(0.05)  # at its batch: the timed step
    # at another, netpart's price carried over by what the timed step made of it at 32
    update = values * UPDATE_S_PER_VALUE
    spec = load_spec("tiny-mlp")
    at = {
        b: plan(spec, 1, seed=0, batch=b, network=model).metrics.predicted_step_s + update
        for b in (16, 32)
    }
    assert replica_s("tiny-mlp", 16) == pytest.approx(at[16] * 0.05 / at[32])
    # a model calibration did not time: netpart's step and the update, as before
    digits = load_spec("digits-mlp")
    one = plan(digits, 1, seed=0, batch=32, network=model).metrics.predicted_step_s
    n = digits.num_params
    ring_3 = max(ps.allreduce_s(3, 4.0 * n), replace(model, ps=None).allreduce_s(n, 3))
    rows = advise(digits, 3, model, batch=32).layouts
    row = next(f for f in rows if f.layout.mode == "allreduce")
    assert row.step_s == pytest.approx(one + ring_3 + n * UPDATE_S_PER_VALUE)
    for bad in ({"seconds": {"tiny-mlp": 0.05}}, {"batch": 32, "seconds": {"tiny-mlp": 0}}):
        with pytest.raises(ValueError, match="replica"):
            PsExchange.from_dict({**tables().to_dict(), "replica": bad})


@pytest.mark.parametrize(
    "bad",
    [
        {"sizes": SIZES, "seconds": {"sync": {"1": [1, 2, 3, 4]}}, "busy": {}},
        {
            "sizes": SIZES,
            "seconds": {"sync": {"1": [1, 2, 3]}, "downpour": {"1": [1, 2, 3, 4]}},
            "busy": {"sync": {"1": [1, 2, 3, 4]}, "downpour": {"1": [1, 2, 3, 4]}},
        },
        {
            "sizes": SIZES,
            "seconds": {"sync": {"0": [1, 2, 3, 4]}, "downpour": {"1": [1, 2, 3, 4]}},
            "busy": {"sync": {"1": [1, 2, 3, 4]}, "downpour": {"1": [1, 2, 3, 4]}},
        },
        {"seconds": {}},
    ],
)
def test_a_malformed_table_is_refused_in_one_line(tmp_path, bad):
    profile = tmp_path / "p.json"
    model = Machine(kinds={}, profile="p", ps=tables()).to_dict()
    profile.write_text(json.dumps({"schema_version": 2, "model": {**model, "ps": bad}}))
    with pytest.raises(PlanError, match=r"^--profile .*ps") as err:
        Machine.from_profile(profile.read_text(), str(profile))
    assert "\n" not in str(err.value)


def test_measured_tables_price_sync_as_a_sum_and_downpour_by_what_limits_it():
    spec = load_spec("tiny-mlp")
    plain = Machine()
    one = {str(f.layout): f for f in advise(spec, 2, plain, batch=16).layouts}
    nbytes = one["downpour 1x1+1"].link_bytes  # one replica, one shard: a worker's bytes
    compute = plan(spec, 1, seed=0, batch=16, network=plain).metrics.predicted_step_s
    net = Machine(ps=tables(sync_s=1e-6, down_s=1e-6, busy_s=1e-9))
    by = {str(f.layout): f for m in (2, 3) for f in advise(spec, m, net, batch=16).layouts}
    exchange = 1e-6 * nbytes
    assert by["sync 1x1+1"].step_s == pytest.approx(compute + exchange, rel=0.05)
    # Downpour: the exchange limits it (little busy time); two shards each serve their
    # values, two replicas through one shard double it
    two = by["downpour 1x1+2"]
    assert two.step_s == pytest.approx(1e-6 * two.link_bytes, rel=0.05)
    assert two.step_s < 0.7 * exchange
    assert by["downpour 2x1+1"].step_s == pytest.approx(2 * exchange, rel=0.05)
    # where the exchange keeps the machine busy, Downpour pays for it beside the step
    busy = Machine(ps=tables(sync_s=1e-12, down_s=1e-12, busy_s=1e-6))
    b = {str(f.layout): f for f in advise(spec, 2, busy, batch=16).layouts}
    assert b["downpour 1x1+1"].step_s == pytest.approx(compute + exchange, rel=0.05)


def test_a_worker_spread_over_shards_is_priced_off_its_own_table():
    spec = load_spec("tiny-mlp")
    base = tables(sync_s=1e-6, down_s=1e-6, busy_s=1e-9)
    spread = {m: {"2": [0.9e-6 * b for b in SIZES]} for m in ("sync", "downpour")}
    busy = {m: {"2": [2e-9 * b for b in SIZES]} for m in ("sync", "downpour")}
    ps = PsExchange.from_dict({**base.to_dict(), "spread": spread, "spread_busy": busy})
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.busy_s("downpour", 1e5, shards=3) == pytest.approx(2e-4)
    assert ps.busy_s("downpour", 1e5) == base.busy_s("downpour", 1e5) == pytest.approx(1e-4)
    # more shards than measured: as the most measured; one shard: the one-client table
    assert ps.spread_s("sync", 3, 1e5) == ps.spread_s("sync", 2, 1e5) == pytest.approx(0.09)
    assert ps.spread_s("sync", 1, 1e5) == ps.seconds_s("sync", 1, 1e5)
    with pytest.raises(ValueError, match=r"ps\.spread"):
        PsExchange.from_dict({**base.to_dict(), "spread": {"sync": {"2": [1.0]}}})
    by = {str(f.layout): f for f in advise(spec, 3, Machine(ps=ps), batch=16).layouts}
    alone = {str(f.layout): f for f in advise(spec, 3, Machine(ps=base), batch=16).layouts}
    two = {str(f.layout): f for f in advise(spec, 2, Machine(ps=ps), batch=16).layouts}
    nbytes = two["downpour 1x1+1"].link_bytes  # one shard holds all the worker's values
    # without the table the two shards' halves price it; with it, the worker's own exchange
    assert alone["downpour 1x1+2"].step_s < 0.7 * 1e-6 * nbytes
    assert by["downpour 1x1+2"].step_s == pytest.approx(0.9e-6 * nbytes, rel=0.05)


def test_a_sync_step_is_its_measured_exchange_whatever_the_client_spends_on_it():
    """The sync exchange's measured time holds the client's CPU: busy time longer than it
    (a client that spins while it waits) does not lengthen a sync step, only Downpour's."""
    spec = load_spec("tiny-mlp")
    compute = plan(spec, 1, seed=0, batch=16, network=Machine()).metrics.predicted_step_s
    ps = tables(sync_s=1e-6, down_s=1e-6, busy_s=3e-6)
    by = {str(f.layout): f for f in advise(spec, 2, Machine(ps=ps), batch=16).layouts}
    nbytes = by["sync 1x1+1"].link_bytes
    loop = LOOP_CPU_S  # the training loop's own, beside the step either way
    assert by["sync 1x1+1"].step_s == pytest.approx(compute + loop + 1e-6 * nbytes, rel=0.05)
    assert by["downpour 1x1+1"].step_s == pytest.approx(compute + loop + 3e-6 * nbytes, rel=0.05)


def test_the_training_loop_is_priced_in_the_machine_s_own_figures():
    """The loop's CPU follows the machine: as many of its smallest dense slices as it took
    where it was measured, so a machine whose slices cost twice as much pays twice the loop
    in every layout; without dense figures, the measured constant."""
    assert loop_cpu_s(Machine()) == LOOP_CPU_S
    spec = load_spec("tiny-mlp")
    ps = tables(sync_s=1e-6, down_s=1e-6, busy_s=1e-9)
    steps, loops = [], []
    for floor in (0.25e-3, 0.5e-3):
        dense = KindCost(((1.0, floor), (1e9, floor + 0.05)))
        network = Machine(kinds={"dense": dense}, ps=ps)
        loops.append(loop_cpu_s(network))
        compute = plan(spec, 1, seed=0, batch=16, network=network).metrics.predicted_step_s
        by = {str(f.layout): f for f in advise(spec, 2, network, batch=16).layouts}
        priced = compute + loops[-1] + 1e-6 * by["sync 1x1+1"].link_bytes
        assert by["sync 1x1+1"].step_s == pytest.approx(priced, rel=0.05)
        steps.append(by["sync 1x1+1"].step_s - compute)
    assert loops == pytest.approx([LOOP_DENSE_SLICES * 0.25e-3, LOOP_DENSE_SLICES * 0.5e-3])
    assert steps[1] - steps[0] == pytest.approx(loops[1] - loops[0], rel=1e-6)


def test_replicas_of_several_shards_are_priced_off_the_mesh_of_clients_and_shards():
    """Each shard serving R clients, each client S shards: the measured pair (R, S), not the
    longer of one client of S shards and R clients of one shard."""
    spec = load_spec("tiny-mlp")
    base = tables(sync_s=1e-6, down_s=1e-6, busy_s=1e-9)
    spread = {m: {"2": [0.5e-6 * b for b in SIZES]} for m in ("sync", "downpour")}
    mesh = {
        m: {"2x2": [3e-6 * b for b in SIZES], "3x2": [4e-6 * b for b in SIZES]}
        for m in ("sync", "downpour")
    }
    busy = {
        m: {"2x2": [2e-9 * b for b in SIZES], "3x2": [2e-9 * b for b in SIZES]}
        for m in ("sync", "downpour")
    }
    ps = PsExchange.from_dict(
        {**base.to_dict(), "spread": spread, "spread_busy": spread, "mesh": mesh, "mesh_busy": busy}
    )
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.exchange_s("sync", 2, 2, 1e5) == pytest.approx(0.3)
    assert ps.exchange_s("sync", 3, 2, 1e5) == pytest.approx(0.4)
    assert ps.exchange_s("sync", 4, 3, 1e5) == pytest.approx(0.4)  # beyond: the nearest
    assert ps.exchange_s("sync", 1, 2, 1e5) == ps.spread_s("sync", 2, 1e5)
    assert ps.busy_s("downpour", 1e5, shards=2, clients=2) == pytest.approx(2e-4)
    for key in ("1x2", "2x", "x2", "2"):
        with pytest.raises(ValueError, match=r"ps\.mesh"):
            PsExchange.from_dict(
                {**ps.to_dict(), "mesh": {"sync": {key: [1.0] * 4}, "downpour": mesh["downpour"]}}
            )
    by = {str(f.layout): f for f in advise(spec, 4, Machine(ps=ps), batch=16).layouts}
    one = {str(f.layout): f for f in advise(spec, 2, Machine(ps=ps), batch=16).layouts}
    compute = plan(spec, 1, seed=0, batch=16, network=Machine()).metrics.predicted_step_s
    nbytes = one["sync 1x1+1"].link_bytes  # a worker's bytes
    assert by["sync 2x1+2"].step_s == pytest.approx(compute + LOOP_CPU_S + 3e-6 * nbytes, rel=0.05)
    three = {str(f.layout): f for f in advise(spec, 3, Machine(ps=ps), batch=16).layouts}
    priced = compute + LOOP_CPU_S + 0.5e-6 * nbytes
    assert three["sync 1x1+2"].step_s == pytest.approx(priced, rel=0.05)


def test_on_a_share_of_a_core_a_step_pays_its_cpu_over_the_share_and_the_exchanges():
    """A step within the quota ran alone at a whole core's speed (its time is its CPU); the
    quota holds it and the exchange, so a step of either mode is at least that CPU / share
    plus the busy time. A step longer than the quota was timed throttled: its CPU is time x
    share. On whole cores a sync step is its step and exchange, whatever the busy time."""
    spec = load_spec("tiny-mlp")
    step = plan(spec, 1, seed=0, batch=16, network=Machine()).metrics.predicted_step_s
    whole = tables(sync_s=1e-9, down_s=1e-9, busy_s=1e-8)
    quota = PsExchange.from_dict({**whole.to_dict(), "share": 0.25, "quota_s": 1.0})
    assert quota.to_dict()["share"] == 0.25 and "share" not in whole.to_dict()
    assert PsExchange.from_dict(json.loads(json.dumps(quota.to_dict()))) == quota
    assert quota.step_cpu_s(0.5) == 0.5  # within the quota: its time
    assert quota.step_cpu_s(8.0) == 2.0 and quota.step_cpu_s(2.0) == 1.0  # x share, >= quota
    assert whole.step_cpu_s(8.0) == 8.0
    by = {
        name: {str(f.layout): f for f in advise(spec, 2, Machine(ps=ps), batch=16).layouts}
        for name, ps in (("whole", whole), ("quota", quota))
    }
    busy = by["whole"]["downpour 1x1+1"].step_s - step - LOOP_CPU_S  # the loop's own CPU too
    assert busy > 0
    cpu = (step + LOOP_CPU_S) / 0.25
    assert by["quota"]["downpour 1x1+1"].step_s == pytest.approx(cpu + busy)
    assert by["quota"]["sync 1x1+1"].step_s == pytest.approx(cpu + busy)
    # its exchange: 1/10 the busy
    assert by["whole"]["sync 1x1+1"].step_s < step + LOOP_CPU_S + busy / 5
    for bad in ({"share": 0}, {"share": 1.5}, {"quota_s": -1}, {"share": "half"}):
        with pytest.raises(ValueError, match=r"ps\.share"):
            PsExchange.from_dict({**whole.to_dict(), **bad})


def test_exchanges_timed_after_a_stand_in_step_carry_what_their_price_missed_to_a_model():
    """`after`: the stand-in priced as a model's step is, against what it measured; the miss
    is carried over in proportion to the model's step CPU, up to the stand-in's."""
    spec = load_spec("tiny-mlp")
    compute = plan(spec, 1, seed=0, batch=16, network=Machine()).metrics.predicted_step_s
    base = tables(sync_s=1e-6, down_s=1e-12, busy_s=1e-9)
    # the stand-in's price (whole cores): sync its step, the loop and the exchange; Downpour
    # its step, the exchange's busy time and the loop, the exchange beside them (shorter)
    priced = {
        "sync": lambda s, b: s + LOOP_CPU_S + 1e-6 * b,
        "downpour": lambda s, b: s + 1e-9 * b + LOOP_CPU_S,
    }

    def after(stand_in_s: float, extra: float) -> PsExchange:
        seconds = {m: {"1x1": [f(stand_in_s, b) + extra for b in SIZES]} for m, f in priced.items()}
        raw = {"sizes": SIZES, "stand_in_s": stand_in_s, "seconds": seconds}
        return PsExchange.from_dict({**base.to_dict(), "after": raw})

    ps = after(0.1, 0.02)
    assert PsExchange.from_dict(json.loads(json.dumps(ps.to_dict()))) == ps
    assert ps.after_s("sync", 1, 1, 1e5) == pytest.approx(0.1 + LOOP_CPU_S + 0.1 + 0.02)
    assert ps.after_s("sync", 2, 1, 1e5) is None  # a pair not measured: no correction
    assert base.after_s("sync", 1, 1, 1e5) is None and "after" not in base.to_dict()

    def steps(ps: PsExchange) -> dict[str, float]:
        layouts = advise(spec, 2, Machine(ps=ps), batch=16).layouts
        return {str(f.layout): f.step_s for f in layouts}

    alone = steps(base)
    for stand_in_s, weight in ((0.1, compute / 0.1), (compute / 2, 1.0)):
        got = steps(after(stand_in_s, 0.02))
        for name in ("sync 1x1+1", "downpour 1x1+1"):
            assert got[name] == pytest.approx(alone[name] + weight * 0.02, rel=1e-6), name
    three = advise(spec, 3, Machine(ps=after(0.1, 0.02)), batch=16).layouts
    before = advise(spec, 3, Machine(ps=base), batch=16).layouts
    by, was = ({str(f.layout): f.step_s for f in rows} for rows in (three, before))
    assert by["sync 2x1+1"] == was["sync 2x1+1"]  # 2 clients of 1 shard not measured: as before
    assert by["sync 1x1+2"] == was["sync 1x1+2"]  # 1x2 neither
    for bad in (
        {"sizes": SIZES, "seconds": {}},
        {"sizes": [], "stand_in_s": 0.1},
        {"sizes": SIZES, "stand_in_s": 0, "seconds": ps.to_dict()["after"]["seconds"]},
        {**ps.to_dict()["after"], "seconds": {"sync": {"0x1": [1.0] * 4}}},
    ):
        with pytest.raises(ValueError, match=r"ps\.after"):
            PsExchange.from_dict({**base.to_dict(), "after": bad})
