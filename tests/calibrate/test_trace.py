"""Slice traces: every slice of a plan timed alone, as calibration reads them."""

import numpy as np
import pytest
import torch

from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan


def test_a_slice_on_a_share_of_a_core_counts_its_cpu_time_over_the_share(monkeypatch):
    """Under a cpu quota the best wall time of a short run found the quota unspent: each run
    counts at least its CPU time / share (a fake clock: 1 ms of CPU, 1.5 ms of wall per call
    pair)."""
    import itertools

    from netpart import timing
    from netpart.calibrate import trace

    cpu, wall = itertools.count(0, 1e-3), itertools.count(0, 1.5e-3)
    monkeypatch.setattr(timing.time, "thread_time", lambda: next(cpu))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(wall))
    spec = load_spec("tiny-local")
    blocks = build_unit_graph(spec, plan(spec, 1, "metis").granularity).layers[1]
    layer_slice = trace.build_slice(spec, 1, np.arange(8), blocks, None, torch.float32)
    x = torch.randn(spec.input_shape(1).size + 2, 4, requires_grad=True)
    assert trace._time_slice(layer_slice, x, share=1.0) == pytest.approx((1.5e-3, 1.5e-3))
    assert trace._time_slice(layer_slice, x, share=0.25) == pytest.approx((4e-3, 4e-3))
    with pytest.raises(ValueError, match="fraction of one core"):
        trace.measure_slices(spec, plan(spec, 1, "metis"), 4, share=0.0)
