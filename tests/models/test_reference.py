import numpy as np
import pytest
import torch
from hypothesis import given, settings

from netpart.models import ZOO, build_reference, init_rows
from netpart.nn import LocallyConnected2d
from tests.conftest import small_specs


@given(small_specs())
@settings(max_examples=40, deadline=None)
def test_reference_runs_and_counts_params(spec):
    model = build_reference(spec, seed=3, dtype=torch.float64)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    x = torch.randn(2, spec.input.shape.size, dtype=torch.float64)
    out = model(x)
    assert (
        out.shape
        == (2, spec.shapes[-1].channels, spec.shapes[-1].height, spec.shapes[-1].width)[: out.dim()]
    )
    assert torch.isfinite(out).all()


def test_weights_depend_only_on_spec_and_seed():
    spec = ZOO["tiny-local"]
    a = build_reference(spec, seed=7).state_dict()
    b = build_reference(spec, seed=7).state_dict()
    c = build_reference(spec, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.weight"], c["layers.0.weight"])


def test_a_slice_of_rows_equals_the_same_rows_of_the_whole_layer():
    spec = ZOO["tiny-local"]
    full = build_reference(spec, seed=1, dtype=torch.float64)
    rows = np.array([5, 0, 17])
    part = init_rows(spec, 1, 0, rows)
    assert np.array_equal(part, full.layers[0].weight.detach().numpy()[rows])
    dense_rows = init_rows(spec, 1, 4, np.array([9]))
    assert np.array_equal(dense_rows[0], full.layers[4].weight.detach().numpy()[9])


def test_locally_connected_matches_explicit_loops():
    torch.manual_seed(0)
    mod = LocallyConnected2d(2, 3, (6, 5), kernel_size=3, stride=2, padding=1).double()
    assert mod.out_shape == (3, 3, 3)
    with torch.no_grad():
        mod.weight.normal_()
        mod.bias.normal_()
    x = torch.randn(2, 2, 6, 5, dtype=torch.float64)
    got = mod(x)
    xp = torch.nn.functional.pad(x, (1, 1, 1, 1))
    want = torch.empty_like(got)
    for y in range(3):
        for xx in range(3):
            patch = xp[:, :, 2 * y : 2 * y + 3, 2 * xx : 2 * xx + 3].reshape(2, -1)
            want[:, :, y, xx] = patch @ mod.weight[y * 3 + xx] + mod.bias[:, y, xx]
    assert torch.allclose(got, want, atol=1e-12)


def test_lcn_normalises_a_window():
    spec = ZOO["tiny-local"]
    model = build_reference(spec, dtype=torch.float64)
    lcn = model.layers[2]
    x = torch.randn(1, 8, 7, 7, dtype=torch.float64) * 5 + 3
    y = lcn(x)
    # At the centre the 3x3 window has no padding: mean over window and channels is removed.
    window = x[0, :, 2:5, 2:5]
    m, v = window.mean(), window.pow(2).mean() - window.mean() ** 2
    assert torch.allclose(y[0, :, 3, 3], (x[0, :, 3, 3] - m) / torch.sqrt(v + lcn.eps))


@pytest.mark.parametrize("name", ["tiny-mlp", "tiny-local"])
def test_loss_is_cross_entropy_on_softmax_models(name):
    spec = ZOO[name]
    model = build_reference(spec, dtype=torch.float64)
    x = torch.randn(4, spec.input.shape.size, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 3])
    loss = model.loss(model(x), targets)
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(model(x), targets))


def test_a_model_built_from_netpart_nn_is_the_reference_of_its_spec():
    """`netpart.nn`'s layers, composed with torch's own as a user writes a model, compute the
    reference model of the same spec exactly, given the same weights (issue 78)."""
    from torch import nn

    from netpart.models import ModelSpec
    from netpart.nn import L2Pool2d, LocalContrastNorm

    spec = ModelSpec.from_dict(
        {
            "name": "user",
            "input": {"channels": 2, "height": 12, "width": 12},
            "layer": [
                {"kind": "local", "channels": 4, "kernel": 3, "activation": "relu"},
                {"kind": "pool", "mode": "l2", "kernel": 2},
                {"kind": "lcn", "kernel": 3},
                {"kind": "dense", "units": 5, "activation": "softmax"},
            ],
        }
    )
    user = nn.Sequential(
        LocallyConnected2d(2, 4, (12, 12), kernel_size=3),
        nn.ReLU(),
        L2Pool2d(2),
        LocalContrastNorm(3),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 5),
    ).double()
    reference = build_reference(spec, seed=3, dtype=torch.float64)
    index = {"0": "layers.0", "3": "layers.2", "5": "layers.3"}  # the user's -> the spec's

    def named(key: str) -> str:
        module, name = key.split(".")
        return f"{index[module]}.{name}"

    assert {named(k) for k in user.state_dict()} == set(reference.state_dict())
    user.load_state_dict({k: reference.state_dict()[named(k)] for k in user.state_dict()})
    x = torch.randn(3, 2, 12, 12, dtype=torch.float64)
    assert torch.allclose(user(x), reference(x), rtol=0, atol=1e-12)
