"""A user's nn.Module read into a spec (issue 78, the import): what is read, what the read
spec computes against the user's module, and what is refused in one line."""

import re
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from netpart.cli import main
from netpart.errors import SpecError
from netpart.models import load_spec
from netpart.models.importer import import_model, load_module, parse_input
from netpart.nn import L2Pool2d, LocalContrastNorm, LocallyConnected2d
from tests.conftest import users_reference


class LeNet(nn.Module):
    """LeNet-5 as a PyTorch user writes it: modules and their functional forms mixed."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.pool2 = nn.AvgPool2d(2)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool1(F.relu(self.conv1(x)))
        x = self.pool2(torch.tanh(self.conv2(x)))
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        return self.fc3(self.fc2(x).sigmoid())


def distbelief():
    return nn.Sequential(
        LocallyConnected2d(3, 8, (16, 16), kernel_size=5),
        nn.ReLU(),
        L2Pool2d(2),
        LocalContrastNorm(3),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    )


@pytest.mark.parametrize(
    "make, shape, kinds",
    [
        (LeNet, "1x28x28", ["conv", "pool", "conv", "pool", "dense", "dense", "dense"]),
        (distbelief, "3x16x16", ["local", "pool", "lcn", "dense"]),
    ],
)
def test_a_user_s_module_reads_into_a_spec_whose_reference_computes_what_it_does(
    make, shape, kinds
):
    user = make().double()
    spec = import_model(user, parse_input(shape), "net")
    assert [layer.kind for layer in spec.layers] == kinds
    assert spec.layers[-1].activation == "softmax"  # logits: a classifier
    # The spec's reference module with the user's weights computes the user's logits.
    reference = users_reference(spec, user)
    x = torch.randn(4, *(int(v) for v in shape.split("x")), dtype=torch.float64)
    assert torch.allclose(reference(x), user(x), rtol=0, atol=1e-12)


def test_the_import_command_writes_a_spec_that_plans(tmp_path, capsys):
    net = tmp_path / "net.py"
    net.write_text(
        textwrap.dedent(
            """
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = nn.Sequential(
                        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(8 * 15 * 15, 10),
                    )

                def forward(self, x):
                    return self.body(x)
            """
        )
    )
    out = tmp_path / "net.toml"
    assert main(["import", f"{net}:Net", "--input", "3x32x32", "--out", str(out)]) == 0
    spec = load_spec(out)
    assert [layer.kind for layer in spec.layers] == ["conv", "pool", "dense"]
    assert main(["plan", "--model", str(out), "--workers", "2"]) == 0


def test_what_netpart_cannot_read_is_one_line_naming_it(tmp_path, capsys):
    net = tmp_path / "bad.py"
    net.write_text(
        textwrap.dedent(
            """
            from torch import nn

            class Normed(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.conv = nn.Conv2d(3, 4, 3)
                    self.norm = nn.LayerNorm([4, 6, 6])

                def forward(self, x):
                    return self.norm(self.conv(x))

            class Looping(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.conv = nn.Conv2d(3, 3, 3, padding=1)

                def forward(self, x):
                    return self.conv(x) if x.sum() > 0 else x

            def lstm():
                return nn.LSTM(4, 4)

            def unflattened():
                return nn.Sequential(nn.Conv2d(3, 2, 3), nn.Linear(6, 4))

            not_a_module = 3
            """
        )
    )
    cases = {
        "Normed": "norm (LayerNorm) is not a layer netpart reads yet; it reads Conv2d",
        "lstm": "a LSTM is not a layer netpart reads yet",
        "Looping": "its forward cannot be traced",
        "unflattened": "reads a 1x2x6x6 tensor; netpart's dense layer reads a flattened",
        "not_a_module": "not_a_module gives a int, not a torch.nn.Module",
        "Nope": "defines no 'Nope'",
    }
    for name, said in cases.items():
        out = tmp_path / f"{name}.toml"
        assert main(["import", f"{net}:{name}", "--input", "3x8x8", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert not out.exists()
    with pytest.raises(SystemExit) as exit_:  # --input is required
        main(["import", f"{net}:Normed"])
    assert exit_.value.code == 2
    with pytest.raises(SpecError, match="give one example's shape"):
        parse_input("3x32")
    with pytest.raises(SpecError, match=r"FILE\.py:NAME"):
        load_module("no-colon")


def test_dropout_modules_drop_the_layer_before_and_what_cannot_be_split_is_refused():
    """nn.Dropout after a layer (after its activation, or before a relu: they commute) is
    that layer's dropout; a functional dropout, one on the input, one before a tanh and a
    second one on the same output are refused in one line each."""
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.Dropout(0.2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.Tanh(),
        nn.Dropout(0.5),
        nn.Linear(4, 3),
    )
    spec = import_model(net, parse_input("1x6x6"), "dropped")
    assert [layer.dropout for layer in spec.layers] == [0.2, 0.1, 0.5, None]
    assert spec.layers[0].activation == "relu"

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(F.dropout(x, 0.5))

    refused = {
        "write it as an nn.Dropout module": Functional(),
        "drops the input": nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3)),
        "2 (Dropout) drops a layer's output twice": nn.Sequential(
            nn.Linear(4, 4), nn.Dropout(0.1), nn.Dropout(0.1), nn.Linear(4, 3)
        ),
        "(tanh) follows a Dropout": nn.Sequential(
            nn.Linear(4, 4), nn.Dropout(0.1), nn.Tanh(), nn.Linear(4, 3)
        ),
    }
    for said, module in refused.items():
        with pytest.raises(SpecError, match=re.escape(said)):
            import_model(module, parse_input("4"), "bad")
