"""The trace-driven step simulation and the slice timer."""

import numpy as np
import pytest

from netpart.calibrate.trace import measure_slices
from netpart.models import load_spec
from netpart.partition import plan
from netpart.partition.cost import NetworkModel
from netpart.partition.graph import BYTES_PER_VALUE
from netpart.partition.simulate import simulate_step

NET = NetworkModel(bandwidth_bps=1e9, latency_s=50e-6)


def test_one_worker_is_the_sum_of_its_slices():
    fwd, bwd = np.array([[0.1], [0.2]]), np.array([[0.3], [0.4]])
    sim = simulate_step(fwd, bwd, np.zeros((2, 1, 1)), 32, NET)
    assert sim.step_s == pytest.approx(1.0) and sim.exchange_s == 0 and sim.loss_s == 0


def test_lockstep_takes_the_slowest_worker_and_shared_cores_the_total():
    fwd = np.array([[0.1, 0.3, 0.2, 0.2]])
    bwd = np.zeros_like(fwd)
    traffic = np.zeros((1, 4, 4))
    assert simulate_step(fwd, bwd, traffic, 8, NET).compute_s == pytest.approx(0.3)
    assert simulate_step(fwd, bwd, traffic, 8, NET, cores=2).compute_s == pytest.approx(0.4)
    assert simulate_step(fwd, bwd, traffic, 8, NET, cores=8).compute_s == pytest.approx(0.3)


def test_exchange_is_latency_plus_the_busier_direction_over_bandwidth_both_ways():
    fwd = bwd = np.zeros((2, 2))
    traffic = np.zeros((2, 2, 2))
    traffic[1, 0, 1] = 1000  # values per example, worker 0 -> 1 in layer 1
    sim = simulate_step(fwd, bwd, traffic, 10, NET)
    one_way = NET.latency_s + 1000 * 10 * BYTES_PER_VALUE * 8 / NET.bandwidth_bps
    assert sim.layer_exchange_s == pytest.approx((0.0, 2 * one_way))
    with pytest.raises(ValueError, match="shapes disagree"):
        simulate_step(fwd, bwd, np.zeros((2, 3, 3)), 10, NET)


def test_every_slice_with_units_is_timed():
    spec = load_spec("tiny-local")
    p = plan(spec, 2, "metis")
    times = measure_slices(spec, p, batch=4)
    assert times.forward.shape == (len(spec.layers), 2) == times.backward.shape
    assert (times.forward > 0).all() and (times.backward[1:] > 0).all()


def test_scaling_experiment_writes_its_figures(tmp_path):
    import json

    from experiments.scaling import main

    assert main(["--models", "tiny-local", "--workers", "1,2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert {r["speedup"] for r in rows if r["workers"] == 1 and r["method"] == "metis"} == {1.0}
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((tmp_path / "traces").glob("*.npz"))) == 2  # cached for the next run


def test_cached_slice_times_are_refused_when_the_plan_changed(tmp_path):
    """A trace is reused only for the plan it timed: a changed node map is timed again."""
    from experiments.scaling import traced

    class Bar:
        def set_postfix_str(self, _text):
            pass

    spec = load_spec("tiny-local")
    _, first = traced(spec, "metis", 2, 4, tmp_path, False, Bar())
    (path,) = tmp_path.glob("*.npz")
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["forward"] = arrays["forward"] + 1.0  # a marker: served from the cache or not?
    np.savez(path, **arrays)
    _, cached = traced(spec, "metis", 2, 4, tmp_path, False, Bar())
    assert np.allclose(cached.forward, first.forward + 1.0)
    arrays["plan_digest"] = np.array("another plan")
    np.savez(path, **arrays)
    _, again = traced(spec, "metis", 2, 4, tmp_path, False, Bar())
    assert (again.forward < 1.0).all()  # timed again, not the marked cache
