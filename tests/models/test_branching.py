"""Layer graphs that branch and batch normalisation (issue 79, the spec and the import): a
layer names its inputs, `add` and `concat` merge them, `batchnorm` normalises per channel; a
user's ResNet imports as written and its reference computes what the user's module computes
(train and eval); what does not fit is one line naming both branches; an imported graph plans
and checks equal to the user's module."""

import pytest
import tomllib
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from netpart.cli import main
from netpart.errors import SpecError
from netpart.models import load_spec
from netpart.models.importer import import_model, parse_input, spec_toml
from netpart.models.spec import ModelSpec
from tests.conftest import assert_grads_equal, users_reference
from tests.models.user_models import BasicBlock as NormedBlock
from tests.models.user_models import ResNet20

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class Block(nn.Module):
    """A ResNet basic block without normalisation: an identity shortcut, or a 1x1 stride-2
    projection where the shape changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        same = stride == 1 and cin == cout
        self.shortcut = nn.Identity() if same else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + self.shortcut(x))


class Residual(nn.Module):
    """A small ResNet with an inception-style concatenation before its classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = Block(8, 8, 1)
        self.layer2 = Block(8, 16, 2)
        self.wide = nn.Conv2d(16, 4, 1)
        self.tall = nn.Conv2d(16, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(4)
        self.fc = nn.Linear(24 * 4 * 4, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.stem(x))))
        x = torch.cat([x, self.wide(x), torch.tanh(self.tall(x))], dim=1)
        return self.fc(torch.flatten(self.pool(x), 1))


def test_a_residual_network_imports_as_written_and_its_reference_is_the_module():
    user = Residual().double()
    spec = import_model(user, parse_input("3x32x32"), "Residual")
    kinds = [layer.kind for layer in spec.layers]
    assert kinds.count("add") == 2 and kinds.count("concat") == 1 and not spec.is_chain
    add = spec.layers[kinds.index("add")]
    assert add.activation == "relu" and spec.sources(kinds.index("add")) == (2, 0)
    projection = next(layer for layer in spec.layers if layer.name == "layer2.shortcut")
    assert (projection.kernel, projection.stride) == (1, 2)  # skips inputs: a branch may
    names = spec.state_names()
    assert sorted(names.values()) == sorted(dict(user.named_parameters()))  # every weight
    reference = users_reference(spec, user)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    ours, want = reference(x), user(x)
    assert torch.allclose(ours, want, rtol=0, atol=1e-12)
    ours.square().sum().backward()
    want.square().sum().backward()
    assert_grads_equal(spec, reference, user, atol=1e-12)


def test_the_import_command_writes_the_layer_graph_which_plans_and_checks(tmp_path, capsys):
    out = tmp_path / "net.toml"
    target = "tests.models.user_models:Skip"
    assert main(["import", target, "--input", "3x8x8", "--out", str(out)]) == 0
    text = out.read_text()
    assert "inputs = [1, 0]" in text and "bias = false" in text
    spec = load_spec(out)
    assert spec == load_spec(target, input="3x8x8")
    capsys.readouterr()
    planned = tmp_path / "plan"
    assert main(["plan", "--model", str(out), "--workers", "2", "--out", str(planned)]) == 0
    assert (planned / "plan.json").exists() and (planned / "node_map.npy").exists()
    report = (planned / "report.md").read_text()
    assert "| reads " in report  # the layer graph drawn: the layers each one reads
    capsys.readouterr()
    argv = ["check", "--model", target, "--input", "3x8x8", "--workers", "2"]
    assert main([*argv, "--plan", str(planned)]) == 0
    assert "OK: all within 1e-09" in capsys.readouterr().out


CONV = {"kind": "conv", "channels": 4, "kernel": 3, "padding": 1}


def _spec(*layers):
    return {"name": "g", "input": {"channels": 2, "height": 8, "width": 8}, "layer": list(layers)}


@pytest.mark.parametrize(
    "layers, said",
    [
        (
            [CONV, {**CONV, "stride": 2}, {"kind": "add", "inputs": [0, 1]}],
            "layer 2 (add): layer 0 (4x8x8) and layer 1 (4x4x4) differ; an add needs equal",
        ),
        (
            [CONV, {**CONV, "stride": 2}, {"kind": "concat", "inputs": [0, 1]}],
            "layer 0 (4x8x8) and layer 1 (4x4x4) differ in height or width",
        ),
        ([CONV, {"kind": "add"}], "give the layers it merges"),
        ([CONV, {"kind": "add", "inputs": [0]}], "an add merges two inputs or more"),
        ([CONV, {**CONV, "inputs": [0, "input"]}], "a conv layer reads one input"),
        ([CONV, {**CONV, "inputs": [1]}], "input 1 is not an earlier layer (0 to 0)"),
        ([CONV, {**CONV, "inputs": ["nope"]}], "input 'nope': no layer carries it"),
        ([CONV, {**CONV, "inputs": ["input"]}, CONV], "layer 0 (conv): no layer reads its output"),
        ([CONV, {"kind": "dense", "units": 4}, {"kind": "add", "inputs": [0, 1]}], "one is flat"),
    ],
)
def test_a_layer_graph_that_does_not_fit_is_one_line_naming_both_branches(layers, said):
    with pytest.raises(SpecError, match=None) as err:
        ModelSpec.from_dict(_spec(*layers), "g.toml")
    assert said in str(err.value) and "\n" not in str(err.value)


def test_inputs_name_layers_by_index_name_or_input_and_round_trip():
    spec = ModelSpec.from_dict(
        _spec(
            {**CONV, "name": "a"},
            {**CONV, "name": "b"},
            {"kind": "add", "inputs": ["a", 1], "activation": "relu"},
            {**CONV, "channels": 2, "inputs": ["input"]},
            {"kind": "concat", "inputs": [2, 3]},
            {"kind": "dense", "units": 3, "activation": "softmax"},
        )
    )
    assert spec.sources(2) == (0, 1) and spec.sources(3) == (-1,) and spec.sources(1) == (0,)
    assert spec.shapes[4].channels == 6 and spec.layers[1].inputs is None
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    chain = ModelSpec.from_dict(_spec(CONV, {**CONV, "inputs": [0]}))
    assert chain.is_chain and chain.to_dict() == ModelSpec.from_dict(_spec(CONV, CONV)).to_dict()


def test_what_the_import_cannot_merge_is_one_line():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return x + self.conv(x) * 0.5

    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(x) + 1.0

    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return torch.cat([x, self.conv(x)], dim=2)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return y + torch.relu(y)

    said = {
        Scaled: "mul (mul) is not an operation netpart reads yet",
        Constant: "adds a constant or a scaled operand",
        Rows: "joins along dim 2; netpart concatenates channels (dim 1)",
        Shared: "which other operations read too",
    }
    for make, words in said.items():
        with pytest.raises(SpecError) as err:
            import_model(make(), parse_input("2x6x6"), make.__name__)
        assert words in str(err.value) and "\n" not in str(err.value), err.value


class NormedResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = NormedBlock(8, 8, 1)
        self.layer2 = NormedBlock(8, 16, 2)
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(16, 10)
        self.head = nn.BatchNorm1d(10, momentum=0.2)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.avgpool(self.layer2(self.layer1(x)))
        return self.head(self.fc(torch.flatten(x, 1)))


def test_a_resnet_with_batch_norm_imports_and_its_reference_trains_and_evaluates_as_it(tmp_path):
    """Batch statistics in training (and the running statistics they update), the running
    statistics in evaluation: the reference equals the user's module in float64."""
    user = NormedResNet().double()
    spec = import_model(user, parse_input("3x16x16"), "NormedResNet")
    norms = [i for i, layer in enumerate(spec.layers) if layer.kind == "batchnorm"]
    assert len(norms) == 7 and spec.layers[norms[-1]].momentum == 0.2
    assert spec.num_params == sum(p.numel() for p in user.parameters())
    names = {**spec.state_names(), **spec.buffer_names()}
    assert sorted(names.values()) == sorted(user.state_dict())  # every entry, its own name
    reference = users_reference(spec, user)
    x = torch.randn(6, 3, 16, 16, dtype=torch.float64)
    for step in range(2):  # training: batch statistics; the running ones move alike
        ours, want = reference(x * (step + 1)), user(x * (step + 1))
        assert torch.allclose(ours, want, rtol=0, atol=1e-10)
        ours.square().sum().backward()
        want.square().sum().backward()
    assert_grads_equal(spec, reference, user, atol=1e-9)
    after = user.state_dict()
    for ours, name in spec.buffer_names().items():
        assert torch.allclose(reference.state_dict()[ours].double(), after[name].double())
    reference.eval(), user.eval()
    assert torch.allclose(reference(x), user(x), rtol=0, atol=1e-10)


def test_the_zoo_resnets_are_the_resnets_users_write():
    """resnet-20 is what importing a user's CIFAR ResNet-20 gives, names and all; resnet-50
    has torchvision's parameter count and names (its state_dict loads into that class)."""
    user = ResNet20()
    spec = import_model(user, parse_input("3x32x32"), "ResNet20")
    zoo = load_spec("resnet-20")
    assert spec.fingerprint() == zoo.fingerprint() and spec.layers == zoo.layers
    assert zoo.num_params == sum(p.numel() for p in user.parameters()) == 272_474
    big = load_spec("resnet-50")
    assert big.num_params == 25_557_032  # torchvision.models.resnet50()
    names = {**big.state_names(), **big.buffer_names()}
    assert len(names) == 320  # torchvision's resnet50().state_dict() holds 320 entries
    assert {"conv1.weight", "layer4.2.bn3.running_var", "layer3.0.downsample.1.bias"} <= set(
        names.values()
    )


class GraphNet(nn.Module):
    """A user's module computing a random layer graph: each step reads the last output (and,
    merging, an earlier one): a conv, a batch norm, `+` or `torch.cat`, maybe a relu."""

    def __init__(self, steps, channels, classes=3):
        super().__init__()
        self.steps = steps  # (kind, inputs, relu), inputs into the outputs so far (0: input)
        self.mods = nn.ModuleDict()
        shapes = [channels]
        for k, (kind, inputs, _) in enumerate(steps):
            c = shapes[inputs[0]]
            if kind in ("conv1", "conv3"):
                out = c + k % 2 + 1
                size = 1 if kind == "conv1" else 3
                self.mods[str(k)] = nn.Conv2d(c, out, size, padding=size // 2, bias=k % 3 > 0)
            elif kind == "bn":
                out = c
                self.mods[str(k)] = nn.BatchNorm2d(c)
            elif kind == "add":
                out = c
            else:
                out = sum(shapes[i] for i in inputs)
            shapes.append(out)
        self.fc = nn.LazyLinear(classes)

    def forward(self, x):
        outs = [x]
        for k, (kind, inputs, relu) in enumerate(self.steps):
            xs = [outs[i] for i in inputs]
            if kind == "add":
                y = xs[0] + xs[1]
            elif kind == "cat":
                y = torch.cat(xs, dim=1)
            else:
                y = self.mods[str(k)](xs[0])
            outs.append(torch.relu(y) if relu else y)
        return self.fc(torch.flatten(outs[-1], 1))


@st.composite
def graph_programs(draw):
    """Steps of a `GraphNet`: every step reads the output before it, a merge one earlier too
    (or the same again; an add where the channels agree)."""
    channels = [draw(st.integers(1, 3))]
    steps = []
    for k in range(draw(st.integers(2, 7))):
        last = len(channels) - 1
        kind = draw(st.sampled_from(["conv1", "conv3", "bn", "add", "cat"]))
        same = [i for i in range(last + 1) if channels[i] == channels[last]]  # x + x too
        if kind in ("add", "cat"):
            other = draw(st.sampled_from(same if kind == "add" else list(range(last + 1))))
            inputs = (last, other)
        else:
            inputs = (last,)
        relu = draw(st.booleans())
        steps.append((kind, inputs, relu))
        if kind in ("conv1", "conv3"):
            channels.append(channels[last] + k % 2 + 1)
        elif kind == "cat":
            channels.append(channels[last] + channels[inputs[1]])
        else:
            channels.append(channels[last])
    return channels[0], steps


@given(graph_programs(), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_random_layer_graphs_import_and_their_reference_computes_the_module(program, seed):
    """Any graph of convs, batch norms, additions and concatenations a user writes imports
    into a spec that round-trips (dict and TOML), and whose reference, given the user's
    weights and buffers, computes the user's outputs and gradients in training (float64)."""
    channels, steps = program
    torch.manual_seed(seed)
    user = GraphNet(steps, channels).double()
    x = torch.randn(4, channels, 5, 6, dtype=torch.float64)
    user(x)  # the lazy classifier takes its size
    spec = import_model(user, parse_input(f"{channels}x5x6"), "GraphNet")
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert ModelSpec.from_dict(tomllib.loads(spec_toml(spec))) == spec
    merges = sum(kind in ("add", "cat") for kind, _, _ in steps)
    assert spec.is_chain == (merges == 0 and all(len(i) == 1 for _, i, _ in steps))
    reference = users_reference(spec, user)
    ours, want = reference(x), user(x)
    assert torch.allclose(ours, want, rtol=0, atol=1e-10)
    ours.sum().backward()
    want.sum().backward()
    assert_grads_equal(spec, reference, user, atol=1e-9)


def test_a_batch_norm_of_one_value_per_channel_is_refused_in_one_line(tmp_path, capsys):
    """A batch of 1 under a batch norm after a dense layer: torch's BatchNorm1d refuses to
    train it; check and train say so before any process starts."""
    target = "tests.models.user_models:NormedSkip"
    base = ["--model", target, "--input", "3x8x8", "--workers", "2", "--batch", "1"]
    assert main(["check", *base]) == 2
    assert main(["train", *base, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.count("(batchnorm) sees one value per channel") == 2
    assert not (tmp_path / "run").exists()
