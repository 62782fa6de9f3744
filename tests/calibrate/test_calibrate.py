"""Calibrated step-time model: profile files, the per-kind slice tables, and the planner's
use of them (`netpart calibrate` itself runs once, on two small models)."""

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.calibrate import trust
from netpart.calibrate.fitting import ANCHOR_HIGH, anchored
from netpart.calibrate.measure import (
    crowd_counts,
    fit,
    kind_cost,
    layer_costs,
    slice_points,
    step_cpu_s,
)
from netpart.calibrate.trace import SliceTimes
from netpart.cli import main
from netpart.compile.schedule import plan_schedule
from netpart.cost.machine import PATCHES, Machine
from netpart.cost.sheet import read_sheet
from netpart.cost.step import layer_times
from netpart.cost.tables import KindCost, LayerCost
from netpart.errors import PlanError
from netpart.models import load_spec
from netpart.models.spec import ModelSpec
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.evaluate import chain_shares, interior_shares, reevaluate
from netpart.partition.plans import PartitionPlan
from netpart.partition.volume import layer_traffic
from netpart.planning.sweep import knee, parse_counts
from tests.conftest import chain_specs

CALIBRATED = Machine(
    bandwidth_bps=8e9,
    latency_s=1e-4,
    kinds={"dense": KindCost(((1e4, 1e-4), (1e6, 2e-4), (1e8, 5e-3)))},
    fill_s_per_value=1e-9,
    step_fixed_s=3e-4,
    collective_s=5e-4,
    parallel_slowdown=0.2,
    slice_scale=0.9,
    joined_saving_s=5e-5,
    probe_s=2e-3,
    profile="p.json",
    link={1: ((1e3, 1e-4), (1e4, 2e-4), (1e5, 1.2e-3)), 3: ((3e3, 4e-4), (3e5, 6e-3))},
    gather=((2.0, 1e-3), (4.0, 3e-3)),
)


def _profile_text(model: Machine) -> str:
    return json.dumps({"schema_version": 2, "model": model.to_dict()})


def test_a_profile_round_trips_and_an_uncalibrated_model_keeps_its_three_figures():
    back = Machine.from_profile(_profile_text(CALIBRATED), "p.json")
    assert back == CALIBRATED and back.describe().startswith("calibrated profile p.json:")
    assert Machine.from_dict(CALIBRATED.to_dict()) == CALIBRATED
    own = replace(CALIBRATED, layers={"dense 64->256 units=256": LayerCost(((1e6, 1e-3),), 1e-4)})
    assert Machine.from_profile(_profile_text(own), "p.json") == own
    assert "1 layers' own slice tables" in own.describe()
    assert set(Machine().to_dict()) == {"bandwidth_bps", "latency_s", "flops_per_s"}


@pytest.mark.parametrize(
    "text,why",
    [
        ("not json", "Expecting value"),
        ('{"schema_version": 3, "model": {}}', "schema_version 2"),
        ('{"schema_version": 1, "model": {}}', "an older calibration.*netpart calibrate"),
        ('{"schema_version": 2}', "model"),
        (_profile_text(Machine(step_fixed_s=-1.0, profile="x")), "fixed costs >= 0"),
        (_profile_text(replace(CALIBRATED, layers={"x": LayerCost(((1.0, -1.0),))})), "positive"),
        (_profile_text(replace(CALIBRATED, crowd=((2.0, 0.1, 0.0),))), "crowd needs workers >= 3"),
        (_profile_text(replace(CALIBRATED, crowd=((4.0, -1.2, 0.0),))), "slowdowns must be pos"),
        (_profile_text(replace(CALIBRATED, crowd=((4.0, 0.1, -1.0),))), "fixed costs >= 0"),
        (_profile_text(CALIBRATED).replace('"crowd": []', '"crowd": [[4, NaN, 0]]'), "finite"),
        (_profile_text(CALIBRATED).replace('"crowd": []', '"crowd": [1]'), "crowd is"),
    ],
)
def test_a_bad_profile_is_one_line(text, why):
    with pytest.raises(PlanError, match=why) as err:
        Machine.from_profile(text, "bad.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("--profile bad.json")


def test_slice_table_interpolates_and_extrapolates_at_the_largest_rate():
    cost = KindCost(((1e6, 1e-3), (2e6, 0.9e-3), (4e6, 4e-3)))  # a noisy middle point
    t = cost.seconds(np.array([1e3, 1.5e6, 3e6, 8e6]))
    assert t[0] == pytest.approx(0.95e-3)  # below the table: the smallest size's time
    assert t[1] == pytest.approx(0.95e-3)  # a fall is pooled into its mean (least squares)
    assert t[2] == pytest.approx(2.475e-3)  # interpolated
    assert t[3] == pytest.approx(4e-3 + 4e6 * 1e-9)  # + median s/FLOP of 1e-9, 0.45e-9, 1e-9


def test_one_slow_slice_does_not_scale_the_predictions_above_the_table():
    clean = [(1e6, 1e-3), (2e6, 2e-3), (4e6, 4e-3), (8e6, 8e-3)]
    slow = KindCost(((1e6, 1e-3), (2e6, 2e-3), (4e6, 12e-3), (8e6, 8e-3)))  # 3x at 4e6
    repeated = KindCost((*clean, (8e6, 7e-3), (8e6, 30e-3)))  # one size's median: 8e-3
    assert repeated.seconds(np.array([8e6, 1.6e7])) == pytest.approx([8e-3, 16e-3])
    big = float(slow.seconds(np.array([8e7]))[0])
    assert big == pytest.approx(0.01 + 7.2e7 * 1e-9)  # the rate of the clean sizes, not 3x
    assert np.all(np.diff(slow.seconds(np.linspace(1e6, 8e6, 50))) >= 0)


def test_a_layer_s_own_table_scales_beyond_its_sizes_at_its_nearest_slices_rate():
    own = LayerCost(((1e8, 10e-3), (1.1e8, 12e-3), (2e8, 20e-3), (4e8, 36e-3)), floor_s=1e-3)
    t = own.seconds(np.array([1e6, 5e7, 1.5e8, 8e8]))
    small = np.median([10e-3 / 1e8, 12e-3 / 1.1e8])  # the slices within 1.3x of the smallest
    assert t[0] == pytest.approx(1e-3)  # never below the kind's smallest slice
    assert t[1] == pytest.approx(5e7 * small)
    assert t[2] == pytest.approx(12e-3 + 8e-3 * 0.4 / 0.9)  # between its sizes: interpolated
    assert t[3] == pytest.approx(36e-3 * 2)  # above: at the largest slice's rate


def test_a_layer_with_its_own_table_is_read_off_it_and_the_others_off_their_kind():
    spec = load_spec("digits-mlp")
    keys = [spec.layer_key(i) for i in range(3)]
    own = LayerCost(((1e6, 5e-3), (2e6, 1e-2)))
    net = replace(CALIBRATED, layers={keys[1]: own})
    flops, kinds = np.full((3, 2), 5e4), ["dense"] * 3
    got = net.worker_compute_s(flops, 32, kinds, None, keys)
    assert got[1] == pytest.approx([0.9 * 1.2 * 8e-3] * 2)  # 1.6e6 FLOPs: 8 ms, slowed
    assert got[[0, 2]] == pytest.approx(CALIBRATED.worker_compute_s(flops, 32, kinds)[[0, 2]])
    assert net.worker_compute_s(flops, 32, kinds) == pytest.approx(
        CALIBRATED.worker_compute_s(flops, 32, kinds)
    )  # without the layers' keys: their kind's table
    p = plan(spec, 2, "stripe", batch=32, network=CALIBRATED)
    assert reevaluate(spec, p, 32, net).metrics.compute_s > p.metrics.compute_s


CONV = ModelSpec.from_dict(
    {
        "name": "convs",
        "input": {"channels": 2, "height": 12, "width": 12},
        "layer": [
            {"kind": "conv", "channels": 4, "kernel": 3, "padding": 1},
            {"kind": "pool", "kernel": 2},
            {"kind": "dense", "units": 3, "activation": "softmax"},
        ],
    }
)


def test_a_conv_layer_s_two_paths_are_priced_each_off_its_own_table():
    """Torch's convolution and gathered patches run at different rates: a worker's share of
    each is read off its table at that share of the work; without a patches table the conv
    table prices both."""
    conv = KindCost(((1e3, 1e-4), (1e9, 1e-4 + 1e9 / 40e9)))
    patches = KindCost(((1e3, 3e-4), (1e9, 3e-4 + 1e9 / 10e9)))
    net = Machine(kinds={"conv": conv, PATCHES: patches})
    flops, kinds = np.array([[1e6, 1e6, 1e6]]), ["conv"]
    got = net.worker_compute_s(flops, 32, kinds, convolved=np.array([[1.0, 0.0, 0.25]]))
    whole = 32e6
    assert got[0, 0] == pytest.approx(float(conv.seconds(np.array([whole]))[0]))
    assert got[0, 1] == pytest.approx(float(patches.seconds(np.array([whole]))[0]))
    mixed = conv.seconds(np.array([whole / 4])) + patches.seconds(np.array([whole * 3 / 4]))
    assert got[0, 2] == pytest.approx(float(mixed[0]))
    alone = Machine(kinds={"conv": conv})
    assert alone.worker_compute_s(flops, 32, kinds, convolved=np.array([[1.0, 0.0, 0.25]])) == (
        pytest.approx(alone.worker_compute_s(flops, 32, kinds))
    )
    # a plan: tiles convolve, a random cut gathers patches, and each is priced so
    tiles = plan(CONV, 2, "tiles", batch=32, network=net)
    scattered = plan(CONV, 2, "random", batch=32, network=net)
    assert tiles.layers[0].convolved == 1.0 and scattered.layers[0].convolved == 0.0
    slow = replace(
        net,
        kinds={
            "conv": conv,
            PATCHES: replace(patches, points=tuple((f, 10 * s) for f, s in patches.points)),
        },
    )
    assert reevaluate(CONV, tiles, 32, slow).layers[0].compute_s == tiles.layers[0].compute_s
    assert reevaluate(CONV, scattered, 32, slow).layers[0].compute_s > 5 * (
        scattered.layers[0].compute_s
    )


def test_calibration_times_conv_slices_into_the_conv_and_the_patches_tables():
    """METIS's regions convolve (the conv table), a random cut multiplies patches (the
    patches table); a layer's own table holds its convolved slices alone."""

    class Timed:  # every slice 1 ms: where each lands is the question
        def slices(self, spec, plans, batch):
            times = []
            for p in plans:
                ones = np.full((len(spec.layers), p.workers), 1e-3)
                times.append(SliceTimes(ones, ones, batch))
            return times

    points, per_layer = slice_points([CONV], 8, Timed(), lambda _: None)
    assert len(points["conv"]) >= 1 + 2 + 3  # one worker's whole layer, 2 and 3 tiles
    assert len(points[PATCHES]) >= 2  # the random cut's two workers
    assert len(per_layer[CONV.layer_key(0)]) == len(points["conv"])


def test_layer_tables_are_made_for_layers_timed_at_two_sizes_and_floored_at_their_kind():
    kinds = {"dense": KindCost(((1e3, 2e-4), (1e6, 1e-3)))}
    made = layer_costs({"dense a": [(1e6, 1e-3), (2e6, 2e-3)], "dense b": [(1e6, 1e-3)] * 2}, kinds)
    assert list(made) == ["dense a"] and made["dense a"].floor_s == pytest.approx(2e-4)


def test_a_phase_is_read_off_the_link_table_and_a_cluster_replaces_it():
    t = CALIBRATED.phase_s(np.array([500.0, 5.5e3, 2e5]))
    assert t[0] == 1e-4 and t[1] == pytest.approx(1.5e-4)  # below: the smallest; interpolated
    assert t[2] == pytest.approx(1.2e-3 + 1e5 * 1e-3 / 9e4)  # above: the last segment's rate
    slow_first = Machine(link={1: ((1e3, 5e-4), (4e3, 1e-4), (1e4, 2e-4))})
    assert slow_first.phase_s(np.array([1e3]))[0] == 1e-4  # no message costs more than a larger
    two, five = CALIBRATED.phase_s(np.array([1e4, 3e3]), np.array([2, 5]))  # tables 1, 3
    assert two == pytest.approx(2e-4) and five == pytest.approx(4e-4)
    bare = replace(CALIBRATED, link={})
    assert bare.phase_s(np.array([1e6]))[0] == pytest.approx(1e-4 + 8e6 / 8e9)
    assert Machine.parse("flops=50G", base=CALIBRATED).link == CALIBRATED.link
    assert Machine.parse("bandwidth=10G", base=CALIBRATED).link == {}  # the cluster's
    assert Machine.parse("latency=1ms", base=CALIBRATED).gather == ()
    with pytest.raises(ValueError, match="link needs positive"):
        Machine.from_dict({**CALIBRATED.to_dict(), "link": {"1": [[1e3, -1.0]]}})
    with pytest.raises(ValueError, match="peers >= 1"):
        Machine.from_dict({**CALIBRATED.to_dict(), "link": {"0": [[1e3, 1.0]]}})


def test_the_collective_is_read_off_its_table_by_the_number_of_workers():
    fixed = CALIBRATED.step_fixed_s + CALIBRATED.collective_s
    assert CALIBRATED.fixed_s(1) == CALIBRATED.step_fixed_s  # one worker: no collective
    assert CALIBRATED.fixed_s(2) == pytest.approx(fixed + 1e-3)
    assert CALIBRATED.fixed_s(3) == pytest.approx(fixed + 2e-3)  # interpolated
    assert CALIBRATED.fixed_s(8) == pytest.approx(fixed + 7e-3)  # the last segment's rate
    noisy = replace(CALIBRATED, gather=((2.0, 4e-3), (4.0, 3e-3)))  # fewer can cost no more
    assert noisy.fixed_s(2) == pytest.approx(fixed + 3e-3)
    assert replace(CALIBRATED, gather=()).fixed_s(8) == pytest.approx(fixed)
    with pytest.raises(ValueError, match="workers >= 2"):
        Machine.from_dict({**CALIBRATED.to_dict(), "gather": [[1, 1e-3]]})


def test_steps_at_more_workers_add_their_terms_between_and_beyond_the_counts_measured():
    crowd = replace(CALIBRATED, crowd=((4.0, 0.2, 1e-3), (8.0, 1.0, 3e-3)))
    assert crowd.crowd_terms(2) == (0.0, 0.0) and crowd.crowd_terms(1) == (0.0, 0.0)
    assert crowd.crowd_terms(3) == pytest.approx((0.1, 5e-4))  # from none at 2
    assert crowd.crowd_terms(6) == pytest.approx((0.6, 2e-3))
    assert crowd.crowd_terms(64) == pytest.approx((1.0, 3e-3))  # the largest count's beyond
    assert crowd.fixed_s(6) == pytest.approx(CALIBRATED.fixed_s(6) + 2e-3)
    flops = np.full((1, 6), 5e5)
    ratio = (1 + 0.2 + 0.6) / (1 + 0.2)  # parallel_slowdown 0.2, crowd 0.6 at 6
    assert crowd.worker_compute_s(flops, 32, ["dense"]) == pytest.approx(
        ratio * CALIBRATED.worker_compute_s(flops, 32, ["dense"])
    )
    back = Machine.from_profile(_profile_text(crowd), "p.json")
    assert back == crowd and "steps at 4/8 workers" in back.describe()
    assert Machine.parse("bandwidth=10G", base=crowd).crowd == ()  # the cluster's own
    assert Machine.parse("speed=8x", base=crowd).crowd == crowd.crowd
    assert crowd_counts(2) == [] and crowd_counts(3) == [3] and crowd_counts(4) == [3, 4]
    assert crowd_counts(5) == [3, 4, 5] and crowd_counts(8) == [3, 4, 6, 8]
    assert crowd_counts(64) == [3, 4, 6, 8]


def test_anchoring_scales_each_calibration_model_s_layer_tables_to_its_one_process_step():
    batch = 32
    specs = [load_spec(n) for n in ("tiny-mlp", "digits-mlp")]
    own = LayerCost(((1e5, 1e-4), (1e8, 5e-3)))
    keys = [s.layer_key(i) for s in specs for i in range(len(s.layers))]
    base = replace(CALIBRATED, layers={**dict.fromkeys(keys, own), "dense other": own})

    def steps(plans, factors) -> list:  # one-process steps with the tables x factor
        def scaled(f):
            return replace(base, layers={k: c.scaled(f) for k, c in base.layers.items()})

        pairs = zip(plans, factors, strict=True)
        return [
            reevaluate(s, p, batch, scaled(f)).metrics.predicted_step_s for (s, p, _), f in pairs
        ]

    plans = [(s, plan(s, 1, "metis", batch=batch), plan(s, 2, "metis", batch=batch)) for s in specs]
    measured = steps(plans, (1.3, 0.8))
    got = anchored(base, plans, measured, batch)
    predicted = [reevaluate(s, p, batch, got).metrics.predicted_step_s for s, p, _ in plans]
    assert predicted == pytest.approx(measured) and predicted != pytest.approx(steps(plans, (1, 1)))
    assert got.layers["dense other"] == own and got.kinds == base.kinds  # not calibrated here
    # A layer of two calibration models: the geometric mean of their factors, each at most 2.
    twice = plans[1:] * 2
    got = anchored(base, twice, steps(twice, (1.3, 0.8)), batch)
    assert got.layers[keys[2]].points[1][1] == pytest.approx(5e-3 * (1.3 * 0.8) ** 0.5)
    got = anchored(base, twice, steps(twice, (9.0, 2.0)), batch)
    assert got.layers[keys[2]].points[1][1] == pytest.approx(5e-3 * ANCHOR_HIGH)


def test_fit_recovers_the_terms_that_made_the_runs():
    batch, names = 32, ("tiny-mlp", "digits-mlp", "tiny-local")
    specs = [load_spec(n) for n in names]
    plans = [(s, plan(s, 1, "metis", batch=batch), plan(s, 2, "metis", batch=batch)) for s in specs]
    base = Machine(kinds={"dense": CALIBRATED.kinds["dense"]}, overlap=False)
    sizes, seconds = [1e3, 1e4, 1e5, 1e6], [1e-4, 2e-4, 1.1e-3, 1.0e-2]
    link = {
        "sizes": sizes,
        "seconds": {"1": seconds, "2": [2 * t for t in seconds]},
        "gather_s": {"2": 6e-4, "3": 9e-4},
    }
    overhead, in_step = 5e-5, 8e-5  # per phase beyond the link: exchanging only, in a step
    table = tuple((b, t + overhead) for b, t in zip(sizes, seconds, strict=True))
    two_peers = tuple((2 * b, 2 * t + overhead) for b, t in zip(sizes, seconds, strict=True))
    truth = replace(
        base,
        link={1: table, 2: two_peers},
        step_fixed_s=3e-4,
        joined_saving_s=4e-5,
        gather=((2.0, 6e-4), (3.0, 9e-4)),
    )
    stepping = replace(
        truth, link={k: tuple((b, t + in_step) for b, t in v) for k, v in truth.link.items()}
    )
    runs = []
    for k, (spec, _, two) in enumerate(plans):
        phase_bytes = [2e3 * (k + 1), 5e4 * (k + 1)]
        wire = 2 * sum(float(truth.phase_s(np.array(b))) for b in phase_bytes)
        p = reevaluate(spec, two, batch, truth).metrics
        step = reevaluate(spec, two, batch, stepping).metrics.predicted_step_s
        compute, joined = 1e-3 * (k + 1) ** 2, k + 1
        runs.append(
            {
                "one": {
                    "joined": joined,
                    "compute_s": compute,
                    "step_s": compute + 3e-4 - 4e-5 * joined,
                },
                "two": {
                    "phase_bytes": phase_bytes,
                    "exchange_s": wire,
                    "step_s": step + 2e-3 + 0.3 * p.compute_s,
                },
            }
        )
    model = fit(base, plans, runs, batch, link)
    assert model.link.keys() == {1, 2}  # bytes each way in all: per peer x peers
    assert all(np.allclose(model.link[k], stepping.link[k], rtol=1e-6) for k in (1, 2))
    assert model.step_fixed_s == pytest.approx(3e-4) and model.joined_saving_s == pytest.approx(
        4e-5
    )
    assert model.gather == truth.gather  # measured: the fitted constant is what is beyond it
    assert model.collective_s == pytest.approx(2e-3, rel=1e-3)
    assert model.parallel_slowdown == pytest.approx(0.3, rel=1e-3)
    assert model.crowd == ()
    wide = [(s, plan(s, 4, "metis", batch=batch)) for s in specs]

    def steps_at_4(slowdown: float, seconds: float) -> list:  # as `model` + those terms at 4
        held = replace(model, crowd=((4.0, slowdown, seconds),))
        return [
            (4, [(s, p, reevaluate(s, p, batch, held).metrics.predicted_step_s) for s, p in wide])
        ]

    # Steps at 4 workers that held 1.5 ms and 0.4 x compute more than the model fitted at 2.
    again = fit(base, plans, runs, batch, link, steps_at_4(0.4, 1.5e-3))
    assert replace(again, crowd=()) == model
    ((n, slowdown, seconds),) = again.crowd
    assert n == 4 and slowdown == pytest.approx(0.4, rel=1e-3)
    assert seconds == pytest.approx(1.5e-3, rel=1e-3)
    # Steps that held less than the two-worker terms: a correction down, bounded by them.
    for truth, want in (((-0.1, -5e-4), (-0.1, -5e-4)), ((-0.5, -5e-4), (-0.3, None))):
        ((_, slowdown, seconds),) = fit(base, plans, runs, batch, link, steps_at_4(*truth)).crowd
        assert slowdown == pytest.approx(want[0], rel=1e-3)  # at most parallel_slowdown back
        if want[1] is not None:
            assert seconds == pytest.approx(want[1], rel=1e-3)


def test_a_step_s_cpu_is_its_busiest_worker_s_median_over_every_thread():
    """The CPU a calibration step records (the profile's `cpu_s`): per worker the median
    after the warm-up steps of all its thread groups' CPU, then the busiest worker."""
    quiet = [{"main_cpu_s": 9.0, "gloo_io_cpu_s": 9.0}] + [
        {"main_cpu_s": 1.0, "gloo_io_cpu_s": t} for t in (0.5, 1.0, 2.0)
    ]
    busy = [{"main_cpu_s": 0.0}] + [
        {"main_cpu_s": 3.0, "gloo_io_cpu_s": 0.5, "gloo_io_runqueue_s": 9.0}
    ] * 3
    assert step_cpu_s([quiet, busy], warm=1) == pytest.approx(3.5)
    assert step_cpu_s([quiet], warm=1) == pytest.approx(2.0)
    assert step_cpu_s([quiet[:1], []], warm=1) == 0.0  # exchange-only steps record none


def test_a_kind_s_slices_over_larger_inputs_cost_their_values_where_that_fits_better():
    # Two shapes at each FLOPs: a slice over a large input takes longer than one over a small.
    flops = np.repeat([1e6, 2e6, 4e6, 8e6], 2)
    values = np.tile([1e3, 1e5], 4)
    seconds = 1e-4 + 1e-11 * flops + 1e-9 * values
    cost = kind_cost([(f, v, t, 0.3) for f, v, t in zip(flops, values, seconds, strict=True)])
    assert cost.per_value == pytest.approx(1e-9, rel=1e-6)
    assert cost.seconds(flops, values) == pytest.approx(seconds, rel=1e-6)
    back = KindCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost and back.seconds(np.array([3e6]), 5e4) == cost.seconds(np.array([3e6]), 5e4)
    # Time that does not follow the values: the plain table, as before.
    plain = kind_cost([(f, v, 1e-4 + 1e-11 * f, 0.3) for f, v in zip(flops, values, strict=True)])
    assert plain.per_value == 0.0 and plain.seconds(np.array([3e6])) == pytest.approx(1.3e-4)
    with pytest.raises(ValueError, match="per_value"):
        KindCost.from_dict({**cost.to_dict(), "per_value": -1.0})


def test_the_calibrated_model_adds_its_terms_to_the_prediction():
    spec = load_spec("digits-mlp")
    p = plan(spec, 2, "stripe", batch=32, network=CALIBRATED)
    m = p.metrics
    assert m.predicted_step_s == pytest.approx(m.compute_s + m.exchange_s + 3e-4 + 1e-3 + 5e-4)
    flops = np.array([[5e5, 5e5], [0.0, 0.0]])
    traffic = np.zeros((2, 2, 2))
    compute, exchange = layer_times(flops, traffic, 32, CALIBRATED, ["dense", "dense"])
    want = 0.9 * 1.2 * KindCost.seconds(CALIBRATED.kinds["dense"], np.array(5e5 * 32))
    assert compute[0] == pytest.approx(float(want)) and compute[1] == 0 and not exchange.any()
    one = reevaluate(spec, p, 64, Machine())  # another batch and model, same node map
    assert one.batch == 64 and np.array_equal(one.node_map, p.node_map)
    assert one.metrics.predicted_step_s != m.predicted_step_s
    back = PartitionPlan.from_json(p.to_json(), p.node_map)
    assert back.network == CALIBRATED and back == p


def test_overlap_hides_exchange_behind_interior_compute_and_weight_gradients():
    # One local layer over an input layer; the two workers swap a halo.
    local = KindCost(((1e6, 1e-3), (1e9, 1.0)), forward_share=0.4)
    net = Machine(bandwidth_bps=8e6, latency_s=0.0, kinds={"local": local})  # 1 MB/s
    flops = np.array([[1e6, 1e6], [2e6, 2e6]])  # per example; batch 32: 64 ms per slice
    traffic = np.zeros((2, 2, 2))
    traffic[1, 1, 0] = traffic[1, 0, 1] = 250  # per example: 32 KB a phase, 32 ms at 1 MB/s
    kinds = ["local", "local"]
    interior = np.array([[1.0, 1.0], [0.5, 0.5]])
    work = float(local.seconds(np.array(2e6 * 32)))
    _, bare = layer_times(flops, traffic, 32, replace(net, overlap=False), kinds, None, interior)
    assert bare[1] == pytest.approx(2 * 0.032)  # both phases exposed
    _, hidden = layer_times(flops, traffic, 32, net, kinds, None, interior)
    fwd = max(0.032 - 0.5 * work * 0.4, 0.0)  # the interior half of the forward pass
    bwd = max(0.032 - work * 0.6 / 2, 0.0)  # the weight gradients: half the backward pass
    assert hidden[1] == pytest.approx(fwd + bwd) and hidden[1] < bare[1]
    small = flops / 100  # below SPLIT_MIN_FLOPS: the runtime does not split, nothing hidden
    _, unsplit = layer_times(small, traffic, 32, net, kinds, None, interior)
    assert unsplit[1] == pytest.approx(bare[1])
    assert KindCost.from_dict(local.to_dict()) == local
    with pytest.raises(ValueError, match="forward_share"):
        KindCost.from_dict({"points": [[1, 1]], "forward_share": 1.5})


def test_interior_shares_err_low_against_the_units_the_runtime_splits():
    spec = load_spec("bench-local")
    p = plan(spec, 3, "metis", batch=32)
    graph, schedule = plan_schedule(spec, p, validate=False)
    shares = interior_shares(graph, p.node_map, 3)
    units = np.array(
        [
            [len(i) / max(len(o), 1) for i, o in zip(ins, own, strict=True)]
            for ins, own in zip(schedule.interior, schedule.owned, strict=True)
        ]
    )
    assert (shares <= units + 1e-12).all() and (shares[0] == 1).all()
    assert 0 < shares[2:4].mean() < 1  # the cut layers have interiors and boundaries
    one = plan(spec, 1, "metis", batch=32)
    assert (interior_shares(graph, one.node_map, 1) == 1).all()


@given(chain_specs(), st.integers(2, 4), st.sampled_from(["tiles", "metis", "stripe"]))
@settings(max_examples=25, deadline=None)
def test_chain_shares_are_the_runtime_s_chains_and_err_low(spec, workers, method):
    """On blocks the planner finds only producer chains the schedule builds on units, with a
    late share no larger than theirs (a block holding one early unit is early); their late
    work hides exchange, never adds to it."""
    p = plan(spec, workers, method, batch=4, granularity=Granularity(spatial_blocks=8))
    graph, schedule = plan_schedule(spec, p, split_min_flops=0.0, split=())
    late, feeds = chain_shares(graph, p.node_map, workers)
    for layer, w in zip(*np.nonzero(feeds >= 0), strict=True):
        top = next(b + 1 for a, b in schedule.chains[w] if a <= layer <= b)
        assert feeds[layer, w] == top
        own = len(schedule.owned[layer][w])
        assert late[layer, w] <= 1 - len(schedule.early[layer][w]) / own + 1e-12
    args = (np.full(late.shape, 1e8), schedule.traffic(), 32, Machine())
    kinds, inner = [layer.kind for layer in spec.layers], np.zeros(late.shape)
    _, without = layer_times(*args, kinds, None, inner)
    _, with_chains = layer_times(*args, kinds, None, inner, (late, feeds))
    assert with_chains.sum() <= without.sum()


def test_a_chain_below_the_lcn_hides_its_halo_in_the_prediction():
    spec = load_spec("bench-local")
    p = plan(spec, 2, "tiles", batch=32)
    graph = build_unit_graph(spec, p.granularity)
    late, feeds = chain_shares(graph, p.node_map, 2)
    assert (feeds[:2] == 2).all() and (feeds[2:] == -1).all() and (late[:2] > 0.5).all()
    flops = np.zeros(late.shape)
    np.add.at(flops, (graph.layer_of, p.node_map), graph.flops)
    # splits free: what a chain hides, not whether it pays (tests/partition/test_overlap.py)
    net = replace(Machine.parse("bandwidth=100M,flops=2G"), split_cost=0.0)
    args = (flops, layer_traffic(graph, p.node_map, 2), 32, net, [ly.kind for ly in spec.layers])
    inner = interior_shares(graph, p.node_map, 2)
    _, without = layer_times(*args, None, inner)
    _, with_chain = layer_times(*args, None, inner, (late, feeds))
    assert with_chain[2] < 0.5 * without[2] and (with_chain[3:] == without[3:]).all()


def test_a_cluster_over_a_profile_overlaps_and_a_run_here_does_not():
    assert Machine().overlap and Machine.parse("bandwidth=1G").overlap
    local = replace(CALIBRATED, overlap=False)
    assert Machine.from_dict(local.to_dict()) == local
    assert Machine.parse("bandwidth=10G", base=local).overlap
    with pytest.raises(ValueError, match="overlap"):
        Machine.from_dict({**local.to_dict(), "overlap": "yes"})


def test_speed_makes_every_slice_of_the_profile_that_many_times_faster():
    fast = Machine.parse("bandwidth=1Gbit,speed=8x", base=CALIBRATED)
    flops = np.array([[5e5, 1e5]])
    want = CALIBRATED.worker_compute_s(flops, 32, ["dense"]) / 8
    assert fast.worker_compute_s(flops, 32, ["dense"]) == pytest.approx(want)
    assert Machine.parse("speed=2,flops=10G").flops_per_s == 20e9  # in any order
    assert "slice times x0.113" in replace(fast, profile="p.json").describe()  # 0.9 / 8
    for bad in ("speed=0", "speed=fast"):
        with pytest.raises(PlanError, match="--net"):
            Machine.parse(bad)


def test_calibrate_writes_a_profile_that_plan_and_run_use(tmp_path, capsys, monkeypatch):
    out = tmp_path / "profile.json"
    args = ["calibrate", "--out", str(out), "--models", "tiny-mlp,tiny-local", "--steps", "2"]
    # --force: two steps a model cannot judge a machine's load (tests/calibrate/test_trust.py
    # does); judged untrusted here whatever the host's load, it is kept at once, marked
    args += ["--repeats", "1", "--slice-models", "digits-mlp", "--force"]
    monkeypatch.setattr(trust, "verdict", lambda *_: trust.Verdict(("a stand-in reason",)))
    assert main([*args, "--check-model", "digits-mlp"]) == 0
    said = capsys.readouterr().out
    assert said.count("cannot be trusted: a stand-in reason") == 1
    assert "calibrating again" not in said
    assert "warning: kept with --force: calibrated on a busy machine" in said
    assert "layer tables scaled to each model's one-process step" in said
    assert "speed probe over the runs: 10th-90th percentile" in said
    assert "digits-mlp x 2" in said and "(not fitted on)" in said  # its slices only, above
    model = Machine.from_profile(out.read_text(), str(out))
    assert model.caveat == "calibrated on a busy machine: a stand-in reason"
    kinds = {layer.kind for name in ("tiny-mlp", "tiny-local") for layer in load_spec(name).layers}
    assert set(model.kinds) == kinds  # a slice table for every kind measured
    keys = {
        s.layer_key(i)
        for s in map(load_spec, ("tiny-mlp", "tiny-local", "digits-mlp"))
        for i in range(len(s.layers))
    }
    assert model.layers and set(model.layers) <= keys  # and for layers timed at two sizes
    measured = json.loads(out.read_text())["measurements"]
    # Dense slices of 1-, 2- and 3-worker plans: tiny-mlp's 2 layers, tiny-local's 1 and the
    # slice-only digits-mlp's 3, each 1 + 2 + 3 slices; digits-mlp takes no step.
    assert len(measured["slices"]["dense"]) == (2 + 1 + 3) * 6
    assert [r["model"] for r in measured["runs"]] == ["tiny-mlp", "tiny-local"]
    assert model.bandwidth_bps > 0 and model.slice_scale > 0 and model.probe_s > 0
    assert [n for n, _ in model.gather] == [2.0]  # the loss's collective, measured here
    assert set(measured["anchored"]) == {"tiny-mlp", "tiny-local"}  # tables to their steps
    low, high = measured["probe_spread"]  # the probe's 10th and 90th percentile / its median
    assert 0 < low <= 1 <= high
    assert main(["plan", "--model", "tiny-local", "--workers", "2", "--profile", str(out)]) == 0
    assert f"calibrated profile {out}" in capsys.readouterr().out
    run = ["run", "--model", "tiny-mlp", "--workers", "2", "--steps", "2", "--profile", str(out)]
    assert main([*run, "--stats", str(tmp_path / "s.json")]) == 0
    said = capsys.readouterr().out
    assert f"from the calibrated profile {out}" in said and "speed probe during the run" in said
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["slowdown"] == pytest.approx(stats["probe_s"] / model.probe_s)
    assert main(["plan", "--model", "tiny-mlp", "--workers", "2", "--profile", str(tmp_path)]) == 2
    bad = ["plan", "--model", "tiny-mlp", "--workers", "2", "--profile", str(out), "--net", "x"]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [e.split(":")[2].strip() for e in err] == ["--profile " + str(tmp_path), "--net"]
    cluster = [*bad[:-1], "bandwidth=1Gbit"]  # the profile's compute, the cluster's links
    assert main(cluster) == 0 and ": 1 Gbit/s" in capsys.readouterr().out
    # the machine description beside the profile, and inside it, read by --machine
    machine = tmp_path / "profile.machine.toml"
    described = read_sheet(machine)
    inside = read_sheet(out)  # exact; the TOML states 6 figures
    assert inside.flops_per_s == pytest.approx(described.flops_per_s, rel=1e-5)
    assert described.flops_per_s > 0
    assert set(described.kinds) == kinds and described.memory_bytes > 0
    on = ["plan", "--model", "tiny-local", "--workers", "2", "--machine", str(machine)]
    assert main(on) == 0 and f"({machine})" in capsys.readouterr().out
    assert main([*on, "--profile", str(out)]) == 2


def test_the_knee_is_the_last_count_whose_doubling_still_paid():
    counts = [1, 2, 4, 8, 16]
    steps = [100.0, 50.0, 30.0, 26.0, 25.0]  # gains per doubling 2.0, 1.67, 1.15, 1.04
    assert knee(counts, steps, 1.25) == (4, 16)
    assert knee(counts, steps, 1.1) == (8, 16)
    assert knee([1, 3], [90.0, 30.0], 1.5) == (3, 3)  # 3x over log2(3) doublings: 2.0 each
    assert knee([1, 2, 4], [10.0, 6.0, 7.0], 1.25) == (2, 2)  # past the peak: slower
    dip = [46.0, 43.0, 31.0, 26.0, 25.0]  # the first split gains 1.07x, the second 1.39x
    assert knee(counts, dip, 1.25) == (4, 16)
    assert knee(counts[:2], dip[:2], 1.25) == (1, 2)  # no doubling paid: do not split
    assert parse_counts("1-100") == [1, 2, 4, 8, 16, 32, 64, 100]
    assert parse_counts("8,1,2,2") == [1, 2, 8]
    for bad in ("0,1", "4-2", "a"):
        with pytest.raises(ValueError):
            parse_counts(bad)


def test_plan_sweep_prints_the_knee_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["plan", "--model", "tiny-local", "--sweep", "1-4", "--method", "metis"]
    assert main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads((out / "sweep.json").read_text())
    knee = saved["knee"]
    assert saved["counts"] == [1, 2, 4] and f"book {knee} worker{'s' * (knee != 1)}:" in text
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--model", "tiny-local", "--sweep", "1-4", "--workers", "2"]) == 2
    assert main([*args[:4], "0,2"]) == 2
