import json

import pytest
import torch
from hypothesis import given, settings

from netpart.errors import SpecError
from netpart.models import ZOO, ModelSpec, load_spec
from netpart.models.dropout import DropoutKey, keep_scale
from tests.conftest import small_specs

TOML = """
name = "my-net"
input = { channels = 3, height = 32, width = 32 }
[[layer]]
kind = "local"
channels = 8
kernel = 5
stride = 1
padding = 0
activation = "relu"
[[layer]]
kind = "pool"
mode = "l2"
kernel = 2
stride = 2
[[layer]]
kind = "lcn"
kernel = 5
[[layer]]
kind = "dense"
units = 10
activation = "softmax"
"""


@pytest.mark.parametrize(
    ("name", "target"),
    [("speech", 42e6), ("image-80m", 80e6), ("image-330m", 330e6), ("image-1.7b", 1.7e9)],
)
def test_zoo_sizes_within_ten_percent(name, target):
    assert abs(ZOO[name].num_params - target) <= 0.10 * target


def test_paper_shapes():
    speech = ZOO["speech"]
    assert [s.channels for s in speech.shapes] == [2560] * 4 + [8192]
    assert [ly.activation for ly in speech.layers] == ["sigmoid"] * 4 + ["softmax"]
    big = ZOO["image-1.7b"]
    assert big.shapes[-1].channels == 21841
    assert [ly.kernel for ly in big.layers if ly.kind == "local"] == [10, 10, 10]


def test_issue_toml_example_loads(tmp_path):
    path = tmp_path / "net.toml"
    path.write_text(TOML)
    spec = load_spec(path)
    assert [str(s) for s in spec.shapes] == ["8x28x28", "8x14x14", "8x14x14", "10"]
    assert spec.loss == "cross_entropy"
    assert spec.num_params == 28 * 28 * 8 * (3 * 25 + 1) + (8 * 14 * 14 * 10 + 10)


@given(small_specs())
@settings(max_examples=60, deadline=None)
def test_dict_and_json_round_trip(spec):
    again = ModelSpec.from_json(spec.to_json())
    assert again == spec
    assert again.fingerprint() == spec.fingerprint()
    assert ModelSpec.from_dict(json.loads(spec.to_json())).shapes == spec.shapes


def test_fingerprint_ignores_name_but_not_structure():
    d = ZOO["tiny-local"].to_dict()
    renamed = ModelSpec.from_dict({**d, "name": "other"})
    assert renamed.fingerprint() == ZOO["tiny-local"].fingerprint()
    d["layer"][0]["channels"] = 9
    assert ModelSpec.from_dict(d).fingerprint() != ZOO["tiny-local"].fingerprint()


@pytest.mark.parametrize(
    ("layers", "inp", "message"),
    [
        (
            [{"kind": "local", "channels": 4, "kernel": 9}],
            None,
            "kernel 9 is larger than its input",
        ),
        ([{"kind": "local", "channels": 0, "kernel": 3}], None, "channels must be an integer >= 1"),
        ([{"kind": "conv", "channels": 2}], None, "kernel must be an integer"),
        ([{"kind": "mlp", "units": 3}], None, "unknown kind 'mlp'"),
        ([{"kind": "dense", "units": 3, "kernel": 2}], None, "unknown key 'kernel'"),
        ([{"kind": "pool", "kernel": 2, "mode": "median"}], None, "mode 'median'"),
        ([{"kind": "lcn", "kernel": 4}], None, "lcn kernel must be odd"),
        ([{"kind": "pool", "kernel": 2, "stride": 3}], None, "stride 3 is larger than kernel 2"),
        (
            [{"kind": "conv", "channels": 2, "kernel": [3, 2], "stride": [1, 3]}],
            None,
            "stride 3 is larger than kernel 2 (width)",
        ),
        (
            [{"kind": "conv", "channels": 2, "kernel": [3, 7]}],
            None,
            "kernel 7 (width) is larger than its input 6x6",
        ),
        (
            [{"kind": "pool", "kernel": [2, 2, 2]}],
            None,
            "kernel must be an integer or [height, width]",
        ),
        ([{"kind": "lcn", "kernel": [3, 5]}], None, "kernel must be an integer >= 1"),
        (
            [{"kind": "dense", "units": 3, "activation": "softmax"}, {"kind": "dense", "units": 2}],
            None,
            "softmax is only allowed on the last layer",
        ),
        (
            [{"kind": "dense", "units": 3}, {"kind": "pool", "kernel": 2}],
            None,
            "a spatial layer needs an image input",
        ),
        (
            [{"kind": "dense", "units": 3}],
            {"channels": 0, "height": 4, "width": 4},
            "input.channels",
        ),
        ([], None, "at least one [[layer]]"),
    ],
)
def test_bad_specs_name_the_layer_and_problem(layers, inp, message):
    data = {
        "name": "bad",
        "input": inp or {"channels": 1, "height": 6, "width": 6},
        "layer": layers,
    }
    with pytest.raises(SpecError) as err:
        ModelSpec.from_dict(data, "bad.toml")
    text = str(err.value)
    assert message in text
    assert text.startswith("bad.toml")
    assert "\n" not in text


def test_malformed_toml_says_where(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\ninput = { features = 4 \n[[layer]]\n')
    with pytest.raises(SpecError, match=r"broken\.toml: malformed TOML: .*line 2"):
        load_spec(path)


def test_malformed_json_says_where(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",\n "input": {"features": 4},\n "layer": [,]}')
    with pytest.raises(SpecError, match=r"broken\.json:3:\d+: malformed JSON"):
        load_spec(path)


def test_unknown_model_lists_the_zoo():
    with pytest.raises(SpecError, match=r"unknown model 'resnet'.*speech"):
        load_spec("resnet")


def test_a_layer_key_is_its_kind_options_and_shapes_not_its_model():
    narrow, wide = load_spec("bench-local"), load_spec("bench-local-wide")
    want = "local 3x48x48->24x44x44 channels=24 kernel=5 stride=1 padding=0 activation=relu"
    assert narrow.layer_key(0) == want and wide.layer_key(0) != want
    renamed = ModelSpec.from_json(narrow.to_json().replace('"bench-local"', '"other"'))
    assert renamed.name == "other"
    assert [renamed.layer_key(i) for i in range(6)] == [narrow.layer_key(i) for i in range(6)]


@pytest.mark.parametrize(
    "name, text", [("deep.json", "[" * 100000), ("deep.toml", "a = " + "[" * 100000)]
)
def test_a_spec_nested_too_deeply_is_a_one_line_error(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text + ("]" * 100000))
    with pytest.raises(SpecError, match="nested too deeply to be a spec"):
        load_spec(path)


def test_an_imported_spec_s_layer_names_map_its_parameters_and_leave_the_fingerprint():
    layers = [
        {"kind": "conv", "name": "features.0", "channels": 2, "kernel": 3},
        {"kind": "pool", "name": "pool", "kernel": 2, "mode": "l2", "eps": 0.0},
        {"kind": "pool", "name": "pool", "kernel": 1, "mode": "l2"},  # reused: no weights
        {"kind": "dense", "name": "fc", "units": 3, "activation": "leaky_relu"},
    ]
    data = {"name": "net", "input": {"channels": 1, "height": 6, "width": 6}, "layer": layers}
    spec = ModelSpec.from_dict(data)
    assert spec.layers[3].negative_slope == 0.01  # torch's default slope
    assert spec.layers[1].eps == 0.0 and spec.layers[2].eps is None
    assert spec.state_names() == {
        "layers.0.weight": "features.0.weight",
        "layers.0.bias": "features.0.bias",
        "layers.3.weight": "fc.weight",
        "layers.3.bias": "fc.bias",
    }
    unnamed = [{k: v for k, v in layer.items() if k != "name"} for layer in layers]
    assert ModelSpec.from_dict({**data, "layer": unnamed}).fingerprint() == spec.fingerprint()
    assert ModelSpec.from_json(spec.to_json()) == spec
    # a zoo spec's dict has none of the optional keys: its fingerprint is what it was
    assert "negative_slope" not in str(ZOO["tiny-local"].to_dict())


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"kind": "dense", "units": 2, "negative_slope": 0.1}, "applies to activation leaky_relu"),
        ({"kind": "pool", "kernel": 2, "eps": 0.1}, "eps applies to mode l2 only"),
        ({"kind": "pool", "kernel": 2, "mode": "l2", "eps": -1}, "eps must be a non-negative"),
        ({"kind": "dense", "units": 2, "name": "a b"}, "must be a module path"),
    ],
)
def test_the_new_keys_refuse_what_they_cannot_mean(layer, message):
    data = {"name": "bad", "input": {"channels": 1, "height": 4, "width": 4}, "layer": [layer]}
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict(data, "bad.toml")
    twice = [{"kind": "dense", "units": 2, "name": "fc"}] * 2
    with pytest.raises(SpecError, match="given to two layers with weights"):
        ModelSpec.from_dict({**data, "layer": twice})


def test_a_layer_without_a_bias_counts_and_names_its_weights_alone():
    layers = [
        {"kind": "conv", "name": "c", "channels": 2, "kernel": 3, "bias": False},
        {"kind": "dense", "name": "fc", "units": 3, "bias": True},
    ]
    data = {"name": "nb", "input": {"channels": 1, "height": 5, "width": 5}, "layer": layers}
    spec = ModelSpec.from_dict(data)
    assert spec.layer_params(0) == 2 * 9 and spec.layer_params(1) == 2 * 9 * 3 + 3
    assert set(spec.state_names().values()) == {"c.weight", "fc.weight", "fc.bias"}
    assert "bias" not in spec.to_dict()["layer"][1]  # the default is not written
    assert ModelSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SpecError, match="bias must be true or false"):
        ModelSpec.from_dict({**data, "layer": [{**layers[0], "bias": "no"}]})


def test_dropout_is_a_layer_s_option_that_moves_no_unit():
    """`dropout = p` on any layer but the last: written when set, read back, refused outside
    [0, 1) or on the last layer; plans fit the spec with or without it (the fingerprint)."""
    layers = [
        {"kind": "conv", "channels": 2, "kernel": 3, "dropout": 0.25},
        {"kind": "pool", "kernel": 2, "dropout": 0.5},
        {"kind": "dense", "units": 3},
    ]
    data = {"name": "dr", "input": {"channels": 1, "height": 6, "width": 6}, "layer": layers}
    spec = ModelSpec.from_dict(data)
    assert [layer.dropout for layer in spec.layers] == [0.25, 0.5, None]
    assert spec.to_dict()["layer"][0]["dropout"] == 0.25 and "dropout" not in str(
        spec.to_dict()["layer"][2]
    )
    assert ModelSpec.from_json(spec.to_json()) == spec
    plain = [{k: v for k, v in layer.items() if k != "dropout"} for layer in layers]
    assert ModelSpec.from_dict({**data, "layer": plain}).fingerprint() == spec.fingerprint()
    zero = ModelSpec.from_dict({**data, "layer": [{**layers[0], "dropout": 0}, *layers[1:]]})
    assert zero.layers[0].dropout is None  # 0: none
    for bad, message in ((1.0, "below 1"), (-0.1, "non-negative"), ("x", "a non-negative")):
        with pytest.raises(SpecError, match=message):
            ModelSpec.from_dict({**data, "layer": [{**layers[0], "dropout": bad}, *layers[1:]]})
    with pytest.raises(SpecError, match="dropout on the last layer"):
        ModelSpec.from_dict({**data, "layer": [*layers[:2], {**layers[2], "dropout": 0.1}]})


def test_dropout_masks_are_the_unit_s_and_sample_s_not_the_split_s():
    """A unit's mask for a sample is the same whichever slice of units and samples asks for
    it; about p of the values drop; other steps, layers and seeds draw other masks."""
    key = DropoutKey(seed=3, step=7, first_sample=0)
    whole = keep_scale(0.3, 2, torch.arange(1000), 64, key, torch.float64)
    assert set(whole.unique().tolist()) == {0.0, 1 / 0.7}
    assert abs(float((whole == 0).double().mean()) - 0.3) < 0.01
    part = keep_scale(0.3, 2, torch.tensor([5, 999, 17]), 16, DropoutKey(3, 7, 40), torch.float64)
    assert torch.equal(part, whole[[5, 999, 17]][:, 40:56])
    for other in (DropoutKey(3, 8), DropoutKey(4, 7)):
        assert not torch.equal(
            keep_scale(0.3, 2, torch.arange(1000), 64, other, torch.float64), whole
        )
    assert not torch.equal(keep_scale(0.3, 1, torch.arange(1000), 64, key, torch.float64), whole)


def test_a_window_s_sides_stride_and_padding_may_differ_and_a_square_one_is_as_before():
    """kernel, stride and padding take [height, width]; equal sides read as one number, so
    a square spec written either way has one fingerprint."""
    layers = [
        {"kind": "conv", "channels": 2, "kernel": [3, 5], "stride": [1, 2], "padding": [1, 0]},
        {"kind": "pool", "kernel": [2, 1], "padding": [0, 0]},
    ]
    spec = ModelSpec.from_dict(
        {"name": "r", "input": {"channels": 1, "height": 8, "width": 9}, "layer": layers}
    )
    assert [(s.height, s.width) for s in spec.shapes] == [(8, 3), (4, 3)]
    conv, pool = spec.layers
    assert (conv.kernel, conv.stride, conv.padding) == ((3, 5), (1, 2), (1, 0))
    assert (pool.kernel_hw, pool.stride_hw, pool.padding) == ((2, 1), (2, 1), 0)
    assert spec.layer_params(0) == 2 * (1 * 3 * 5 + 1)
    assert ModelSpec.from_json(spec.to_json()) == spec  # [h, w] in JSON
    square = {"kind": "conv", "channels": 2, "kernel": 3}
    twice = {**square, "kernel": [3, 3], "stride": [1, 1]}
    inp = {"channels": 1, "height": 8, "width": 8}
    one, two = (
        ModelSpec.from_dict({"name": "s", "input": inp, "layer": [x]}) for x in (square, twice)
    )
    assert one.fingerprint() == two.fingerprint() and two.layers[0].kernel == 3
