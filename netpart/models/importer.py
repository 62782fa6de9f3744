"""A user's `nn.Module` read into a spec: `netpart import net.py:Net --input 3x32x32`.

The module is traced with `torch.fx.symbolic_trace` (netpart.nn's layers kept whole as leaf
modules), its shapes propagated with one example input (`ShapeProp`), and its nodes walked in
order: each layer netpart knows becomes a layer of the spec, an activation after a weighted
layer becomes that layer's activation, a flatten leads into the dense layers. Why torch.fx and
not torch.export: fx keeps the user's modules as they are written (`call_module` nodes with
their paths, `nn.Conv2d` rather than its ATen convolution), which is what maps a user's layer
to a spec layer and, later, its parameters to the user's names; a forward that branches on
data cannot be traced symbolically and is refused in one line.

What is recognised (anything else ends in one line naming the module's path, its type and
what is supported): `Conv2d` (any kernel, stride and padding per axis), `Linear` (on a
flattened input), each with a bias or without, `MaxPool2d`, `AvgPool2d` (zero padding
counted), `LPPool2d(2)` (their windows, strides and paddings per axis too), netpart.nn's
`LocallyConnected2d`, `LocalContrastNorm` and `L2Pool2d`, `ReLU`, `LeakyReLU` (its slope),
`GELU` (exact), `SiLU`, `Sigmoid`, `Tanh` and their functional forms, `Dropout` (on the
output of the layer before it, with netpart's plan-independent masks:
`netpart.models.dropout`; its functional form is refused, as no mask can be given to it),
`Flatten`, `torch.flatten`, `view` and `reshape` into a dense layer; `+`, `torch.add` and
`x.add(y)` of two layers' outputs (an `add` layer: a residual addition), `BatchNorm1d` and
`BatchNorm2d` (a `batchnorm` layer, torch's defaults of affine and running statistics), and
`torch.cat` along channels (a `concat` layer), a layer that reads an earlier output than the
last naming it in its `inputs` (a layer graph: `netpart.models.spec`).
Each layer of the spec is named by its module's path (`features.0`), so the parameters map
to the user's names (`ModelSpec.state_names`). A network whose last layer is dense is read as
a classifier: its outputs are logits, trained with cross-entropy (the spec's `softmax`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import sys
from pathlib import Path
from typing import Any

from netpart.errors import SpecError
from netpart.models.spec import ModelSpec

__all__ = [
    "import_model",
    "import_target",
    "is_module_target",
    "load_module",
    "module_weights",
    "parse_input",
    "spec_toml",
]

SUPPORTED = (
    "Conv2d, Linear, MaxPool2d, AvgPool2d, LPPool2d(2), ReLU, LeakyReLU, GELU, SiLU, Sigmoid, "
    "Tanh, Dropout, Flatten, netpart.nn.LocallyConnected2d, netpart.nn.LocalContrastNorm, "
    "netpart.nn.L2Pool2d, BatchNorm1d, BatchNorm2d, + and torch.cat of layers' outputs"
)
ACTIVATIONS = ("relu", "leaky_relu", "gelu", "silu", "sigmoid", "tanh")  # functions' names


def is_module_target(key: str) -> bool:
    """True when `key` names a module ('FILE.py:NAME', 'package.module:NAME') rather than a
    zoo model or a spec file."""
    where, colon, name = key.rpartition(":")
    if not colon or not name.isidentifier() or Path(key).exists():
        return False
    return where.endswith(".py") or all(part.isidentifier() for part in where.split("."))


def import_target(target: str, input: str | None) -> ModelSpec:
    """The module `target` names (`load_module`), read at one example's shape `input`
    ('3x32x32' or '440'); SpecError (one line) for a missing --input or what netpart cannot
    represent."""
    if input is None:
        raise SpecError(
            f"--model {target} is a module: give one example's shape with --input "
            "(CxHxW, e.g. 3x32x32, or N features)"
        )
    shape = parse_input(input)  # before importing anything of the user's
    return import_model(load_module(target), shape, target.rpartition(":")[2])


def parse_input(text: str) -> dict[str, int]:
    """'3x32x32' (an image) or '440' (features) as a spec's input; SpecError otherwise."""
    try:
        sizes = [int(v) for v in text.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) == 1 and sizes[0] > 0:
        return {"features": sizes[0]}
    if len(sizes) == 3 and min(sizes) > 0:
        return dict(zip(("channels", "height", "width"), sizes, strict=True))
    raise SpecError(f"--input {text}: give one example's shape, CxHxW (3x32x32) or N (440)")


def load_module(target: str) -> Any:
    """The `nn.Module` `target` names: 'path/to/net.py:Name' or 'package.module:Name', Name a
    module class built with no arguments or a function returning a module."""
    import torch

    where, _, name = target.rpartition(":")
    if not where or not name:
        raise SpecError(f"--model {target}: give FILE.py:NAME or package.module:NAME")
    source = _source(where, target)
    if not hasattr(source, name):
        raise SpecError(f"--model {target}: {where} defines no {name!r}")
    made = getattr(source, name)
    try:
        module = made() if callable(made) else made
    except TypeError as exc:
        raise SpecError(
            f"--model {target}: {name}() cannot be built without arguments ({_line(exc)})"
        ) from None
    if not isinstance(module, torch.nn.Module):
        got = type(module).__name__
        raise SpecError(f"--model {target}: {name} gives a {got}, not a torch.nn.Module")
    return module


def _source(where: str, target: str) -> Any:
    """The Python module of FILE.py or package.module."""
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise SpecError(f"--model {target}: {where}: no such file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise SpecError(f"--model {target}: {where} fails to import ({_line(exc)})") from None
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a package of the directory it runs in, as `python -m`
    try:
        return importlib.import_module(where)
    except Exception as exc:
        raise SpecError(f"--model {target}: cannot import {where} ({_line(exc)})") from None


def module_weights(target: str, spec: ModelSpec, seed: int) -> dict[str, Any]:
    """The initial weights of the module `target` names, built after
    `torch.manual_seed(seed)`, under the names of `spec`'s reference module (`spec` was
    imported from it); float64 tensors."""
    import torch

    torch.manual_seed(seed)
    state = load_module(target).state_dict()
    ours = {user: name for name, user in spec.state_names().items()}
    missing = sorted(set(ours) - set(state))
    if missing:
        raise SpecError(
            f"--model {target}: its state_dict has no {missing[0]}; was the spec read from it?"
        )
    return {ours[k]: v.detach().to(torch.float64).clone() for k, v in state.items() if k in ours}


def import_model(module: Any, input_shape: dict[str, int], name: str) -> ModelSpec:
    """`module` (an `nn.Module`) read into a spec of input `input_shape` (`parse_input`),
    each layer named by its module's path in `module`; SpecError (one line) for what netpart
    cannot represent."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    torch_layer = type(module).__module__.startswith("torch.nn")  # given alone, not a model
    if torch_layer and not isinstance(module, (*_known(), torch.nn.Sequential)):
        raise SpecError(
            f"{name}: a {type(module).__name__} is not a layer netpart reads yet; it reads "
            f"{SUPPORTED}"
        )
    graph = _trace(module, name)
    walk = _Walk(graph, name)
    walk.check_modules()  # an unsupported module is named before anything runs
    dtype = next((q.dtype for q in module.parameters() if q.is_floating_point()), torch.float32)
    example = torch.zeros(1, *input_shape.values(), dtype=dtype)
    modes = {m: m.training for m in module.modules()}  # shapes read in eval mode: a batch
    graph.eval()  # norm neither needs two examples nor moves the user's running statistics
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints its traceback
            ShapeProp(graph).propagate(example)
    except Exception as exc:
        raise SpecError(
            f"{name}: its forward fails on an input of {_shape(input_shape)} "
            f"({_line(exc.__cause__ or exc)}); is --input one example's shape?"
        ) from None
    finally:
        for m, training in modes.items():
            m.train(training)
    layers = walk.layers()
    if not layers:
        raise SpecError(f"{name}: no layer netpart knows ({SUPPORTED})")
    if layers[-1]["kind"] == "dense" and layers[-1]["activation"] == "none":
        layers[-1]["activation"] = "softmax"  # its outputs are logits
    return ModelSpec.from_dict({"name": name, "input": input_shape, "layer": layers}, name)


def _trace(module: Any, name: str) -> Any:
    import torch.fx

    from netpart import nn as netpart_nn

    keep = (netpart_nn.LocallyConnected2d, netpart_nn.LocalContrastNorm, netpart_nn.L2Pool2d)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            return isinstance(m, keep) or super().is_leaf_module(m, qualname)

    try:
        return torch.fx.GraphModule(module, Tracer().trace(module))
    except Exception as exc:
        raise SpecError(
            f"{name}: its forward cannot be traced ({_line(exc)}); netpart reads a forward "
            "without control flow on the data"
        ) from None


class _Walk:
    """The traced nodes in order, as spec layers (see the module docstring)."""

    def __init__(self, graph: Any, name: str) -> None:
        self.graph, self.name = graph, name
        self.modules = dict(graph.named_modules())
        self.out: list[dict] = []
        self.at: dict[Any, int] = {}  # node -> the spec layer its value is (-1: the input)
        self.node: Any = None  # the node being read
        self.read: int = -1  # the layer it reads (its first input's)

    def check_modules(self) -> None:
        """SpecError naming the first module call netpart does not read."""
        for node in self.graph.graph.nodes:
            if node.op == "call_module" and not isinstance(self.modules[node.target], _known()):
                m = self.modules[node.target]
                raise SpecError(
                    f"{self.name}: {node.target} ({type(m).__name__}) is not a layer netpart "
                    f"reads yet; it reads {SUPPORTED}"
                )

    def layers(self) -> list[dict]:
        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                self.at[node] = -1
            elif node.op in ("call_module", "call_function", "call_method"):
                self._node(node)
        return self.out

    def _node(self, node: Any) -> None:
        meta = node.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            return  # x.size(0) and the like: not a layer
        reads = [a for a in node.all_input_nodes if "tensor_meta" in a.meta]
        if not reads:
            raise SpecError(f"{self.name}: {node.name} reads no layer's output (a constant)")
        self.node, self.read = node, self.at[reads[0]]
        self.at[node] = self.read  # until it makes a layer of its own
        merge = _merge(node)
        if merge is not None:
            self._merge(node, merge, reads)
        elif len(reads) != 1:
            raise SpecError(
                f"{self.name}: {node.name} reads {', '.join(r.name for r in reads)}; netpart "
                "merges outputs by addition (+, torch.add) or torch.cat along channels"
            )
        elif node.op == "call_module":
            self._flat_into(node, reads[0])
            self._module(node.target, self.modules[node.target])
        else:
            self._function(node)

    def _merge(self, node: Any, kind: str, reads: list) -> None:
        """A residual addition or a concatenation along channels: a layer of its own that
        reads the layers its operands are."""
        if kind == "add":  # its operands, one output twice included (x + x)
            operands = [*node.args[:2], *([node.kwargs["other"]] if "other" in node.kwargs else [])]
            reads = [a for a in operands if getattr(a, "meta", {}).get("tensor_meta") is not None]
            if len(reads) != 2 or len(operands) != 2 or node.kwargs.get("alpha", 1) != 1:
                raise SpecError(
                    f"{self.name}: {node.name} adds a constant or a scaled operand; netpart "
                    "adds layers' outputs as they are"
                )
        if kind == "concat":
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            rank = len(node.meta["tensor_meta"].shape)
            if dim not in (1, 1 - rank):
                raise SpecError(
                    f"{self.name}: {node.name} (torch.cat) joins along dim {dim}; netpart "
                    "concatenates channels (dim 1)"
                )
            reads = list(node.args[0])
        inputs = [_input(self.at[r]) for r in reads]
        self.out.append({"kind": kind, "inputs": inputs, "activation": "none"})
        self.at[node] = len(self.out) - 1

    def _flat_into(self, node: Any, read: Any) -> None:
        """A Linear must read a flat [batch, features] input: netpart's dense layer reads the
        whole of the layer before it."""
        from torch import nn

        if isinstance(self.modules[node.target], nn.Linear):
            shape = tuple(read.meta["tensor_meta"].shape)
            if len(shape) != 2:
                raise SpecError(
                    f"{self.name}: {node.target} (Linear) reads a {'x'.join(map(str, shape))} "
                    "tensor; netpart's dense layer reads a flattened [batch, features] input "
                    "(flatten before it)"
                )

    def _module(self, path: str, m: Any) -> None:
        from torch import nn

        from netpart import nn as netpart_nn

        kind = type(m).__name__
        if isinstance(m, nn.Conv2d):
            self._add(path, "conv", _conv(path, m), m.bias is not None, kind)
        elif isinstance(m, nn.Linear):
            self._add(path, "dense", {"units": m.out_features}, m.bias is not None, kind)
        elif isinstance(m, netpart_nn.LocallyConnected2d):
            keys = {"channels": m.out_shape[0], "kernel": _size(m.kernel_size)}
            keys |= {"stride": _size(m.stride), "padding": _size(m.padding)}
            self._add(path, "local", keys, m.bias is not None, kind)
        elif isinstance(m, nn.MaxPool2d | nn.AvgPool2d):
            self._add(path, "pool", _pool(path, m), True, kind)
        elif isinstance(m, netpart_nn.L2Pool2d):
            keys = {"mode": "l2", "kernel": _size(m.kernel_size), "stride": _size(m.stride)}
            keys |= {"padding": _size(m.padding)}
            self._add(path, "pool", keys | _eps(m.eps), True, kind)
        elif isinstance(m, nn.LPPool2d):
            self._add(path, "pool", _lp_pool(path, m), True, kind)
        elif isinstance(m, netpart_nn.LocalContrastNorm):
            self._add(path, "lcn", {"kernel": m.kernel_size, "eps": m.eps}, True, kind)
        elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            self._add(path, "batchnorm", _batchnorm(path, m), True, kind)
        elif isinstance(m, nn.Dropout):
            self._dropout(path, m.p)
        elif isinstance(m, nn.LeakyReLU):
            self._activation(path, "leaky_relu", m.negative_slope)
        elif isinstance(m, nn.GELU):
            self._activation(path, _gelu(path, m.approximate))
        elif isinstance(m, nn.ReLU | nn.SiLU | nn.Sigmoid | nn.Tanh):
            self._activation(path, kind.lower())
        elif not isinstance(m, nn.Flatten | nn.Identity):
            raise SpecError(
                f"{self.name}: {path} ({kind}) is not a layer netpart reads yet; it reads "
                f"{SUPPORTED}"
            )

    def _function(self, node: Any) -> None:
        name = getattr(node.target, "__name__", str(node.target)).removesuffix("_")
        if name == "leaky_relu":
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope")
            self._activation(node.name, name, 0.01 if slope is None else slope)
        elif name == "gelu":
            self._activation(node.name, _gelu(node.name, node.kwargs.get("approximate", "none")))
        elif name in ACTIVATIONS:
            self._activation(node.name, name)
        elif name == "dropout":
            raise SpecError(
                f"{self.name}: {node.name} (torch.nn.functional.dropout): write it as an "
                "nn.Dropout module, whose masks netpart can give in `check` (a function's "
                "draws from torch's generator cannot be split)"
            )
        elif name not in ("flatten", "view", "reshape", "contiguous"):
            raise SpecError(
                f"{self.name}: {node.name} ({name}) is not an operation netpart reads yet; it "
                f"reads {SUPPORTED} and their functional forms"
            )

    def _add(self, path: str, kind: str, keys: dict, bias: bool, type_name: str) -> None:
        weighted = kind in ("conv", "local", "dense")
        if weighted and not bias:
            keys = {**keys, "bias": False}
        activation = {"activation": "none"} if weighted else {}
        inputs = {} if self.read == len(self.out) - 1 else {"inputs": [_input(self.read)]}
        self.out.append({"kind": kind, "name": path, **keys, **activation, **inputs})
        self.at[self.node] = len(self.out) - 1

    def _applied(self) -> dict | None:
        """The layer an activation or a dropout applies to: the one the node reads, where
        nothing else reads that value (else the layer's output would change under a reader
        of it)."""
        if self.read < 0:
            return None
        (read,) = [a for a in self.node.all_input_nodes if "tensor_meta" in a.meta]
        if len(read.users) > 1:
            raise SpecError(
                f"{self.name}: {self.node.name} applies to {read.name}, which other operations "
                "read too; netpart applies an activation or a dropout to a layer's only output"
            )
        return self.out[self.read]

    def _dropout(self, where: str, p: float) -> None:
        """Dropout on the output of the layer it reads (netpart's masks, `models.dropout`)."""
        before = self._applied()
        if before is None or "dropout" in before:
            what = "the input" if before is None else "a layer's output twice"
            raise SpecError(
                f"{self.name}: {where} (Dropout) drops {what}; netpart drops the outputs of a "
                "layer, once"
            )
        if p > 0:
            before["dropout"] = float(p)

    def _activation(self, where: str, name: str, slope: float | None = None) -> None:
        before = self._applied()
        if before is None or before.get("activation") != "none":
            raise SpecError(
                f"{self.name}: {where} ({name}) follows no conv, locally connected, linear, "
                "add or cat layer without one; netpart applies an activation to such a "
                "layer's output"
            )
        if "dropout" in before and name not in ("relu", "leaky_relu"):
            raise SpecError(
                f"{self.name}: {where} ({name}) follows a Dropout; netpart drops after the "
                "activation, which is the same only for relu and leaky_relu: put the "
                "Dropout after it"
            )
        before["activation"] = name
        if slope is not None:
            before["negative_slope"] = float(slope)


def _input(layer: int) -> int | str:
    """A spec's name of what a layer reads: an earlier layer's index, or "input"."""
    return "input" if layer < 0 else layer


def _merge(node: Any) -> str | None:
    """ "add" for a residual addition (`+`, `torch.add`, `x.add(y)`), "concat" for
    `torch.cat`, else None."""
    import operator

    import torch

    if node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add):
        return "add"
    if node.op == "call_method" and node.target in ("add", "add_"):
        return "add"
    if node.op == "call_function" and node.target in (torch.cat, torch.concat):
        return "concat"
    return None


def _batchnorm(path: str, m: Any) -> dict:
    """A BatchNorm1d/2d as torch trains it by default: a scale and shift per channel, running
    statistics updated with a fixed momentum; anything else is refused in one line."""
    if not (m.affine and m.track_running_stats) or m.momentum is None:
        raise SpecError(
            f"{path} ({type(m).__name__}): netpart reads a batch norm with affine=True, "
            "track_running_stats=True and a momentum (torch's defaults)"
        )
    return {"eps": float(m.eps), "momentum": float(m.momentum), "activation": "none"}


def _known() -> tuple[type, ...]:
    """The module types `_Walk` reads."""
    from torch import nn

    from netpart import nn as netpart_nn

    return (
        nn.Conv2d,
        nn.Linear,
        nn.MaxPool2d,
        nn.AvgPool2d,
        nn.LPPool2d,
        nn.ReLU,
        nn.LeakyReLU,
        nn.GELU,
        nn.SiLU,
        nn.Sigmoid,
        nn.Tanh,
        nn.Flatten,
        nn.Identity,
        nn.Dropout,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        netpart_nn.LocallyConnected2d,
        netpart_nn.LocalContrastNorm,
        netpart_nn.L2Pool2d,
    )


def _size(value: Any) -> int | list[int]:
    """A module's kernel, stride or padding as the spec takes it: one integer where both
    axes have it, else [height, width]."""
    if isinstance(value, int):
        return value
    h, w = (int(v) for v in value)
    return h if h == w else [h, w]


def _conv(path: str, m: Any) -> dict:
    if isinstance(m.padding, str):
        raise SpecError(
            f"{path} (Conv2d): padding {m.padding!r}; netpart reads numeric padding (give "
            "padding=k // 2 for 'same' with an odd kernel)"
        )
    if m.groups != 1 or set(m.dilation) != {1} or m.padding_mode != "zeros":
        raise SpecError(f"{path} (Conv2d): groups, dilation and padding_mode are not read yet")
    return {
        "channels": m.out_channels,
        "kernel": _size(m.kernel_size),
        "stride": _size(m.stride),
        "padding": _size(m.padding),
    }


def _pool(path: str, m: Any) -> dict:
    from torch import nn

    def one(v):
        return v if isinstance(v, int) else (v[0] if len(set(v)) == 1 else None)

    kernel, stride, padding = _size(m.kernel_size), _size(m.stride), _size(m.padding)
    if m.ceil_mode:
        raise SpecError(f"{path} ({type(m).__name__}): floor mode only (ceil_mode=False), yet")
    if isinstance(m, nn.AvgPool2d) and (not m.count_include_pad or m.divisor_override):
        raise SpecError(f"{path} (AvgPool2d): netpart's average counts the zero padding")
    if isinstance(m, nn.MaxPool2d) and one(m.dilation) != 1:
        raise SpecError(f"{path} (MaxPool2d): dilation is not read yet")
    mode = "max" if isinstance(m, nn.MaxPool2d) else "avg"
    return {"mode": mode, "kernel": kernel, "stride": stride, "padding": padding}


def _lp_pool(path: str, m: Any) -> dict:
    """`LPPool2d(2, k, s)`: the L2 pool without eps or padding (sqrt(sum x^2))."""
    kernel, stride = m.kernel_size, m.stride if m.stride is not None else m.kernel_size
    if float(m.norm_type) != 2.0 or m.ceil_mode:
        raise SpecError(
            f"{path} (LPPool2d): norm_type {m.norm_type}; netpart reads LPPool2d(2), floor mode"
        )
    return {
        "mode": "l2",
        "kernel": _size(kernel),
        "stride": _size(stride),
        "padding": 0,
        "eps": 0.0,
    }


def _eps(eps: float) -> dict:
    """A pool's eps key: written only where it differs from netpart.nn's default."""
    from netpart.nn import L2_POOL_EPS

    return {} if eps == L2_POOL_EPS else {"eps": float(eps)}


def _gelu(where: str, approximate: str) -> str:
    if approximate != "none":
        raise SpecError(
            f"{where} (GELU): approximate={approximate!r}; netpart reads the exact GELU"
        )
    return "gelu"


def _shape(input_shape: dict[str, int]) -> str:
    return "x".join(str(v) for v in input_shape.values())


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def spec_toml(spec: ModelSpec) -> str:
    """`spec` as the TOML a user reads and edits (docs/spec.md)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return f"[{', '.join(value(x) for x in v)}]"
        return f'"{v}"' if isinstance(v, str) else repr(v)

    inp = ", ".join(f"{k} = {v}" for k, v in spec.input.to_dict().items())
    lines = [f"name = {value(spec.name)}", f"input = {{ {inp} }}"]
    for layer in spec.to_dict()["layer"]:
        lines += ["", "[[layer]]", *(f"{k} = {value(v)}" for k, v in layer.items())]
    return "\n".join(lines) + "\n"
