"""Model specs: frozen, validated descriptions of a layered network.

A `ModelSpec` is an input shape and a sequence of layers, each reading the one before it or
the earlier layers it names (a layer graph). Every layer maps a (C, H, W) activation
to a (C', H', W'); dense layers flatten their input and produce (units, 1, 1). A spec is validated
when it is constructed, so every `ModelSpec` in the program describes a network that can be built.

The schema (TOML, or the same structure as JSON: `input`, then `[[layer]]` tables with a
`kind` and its keys) is documented once, in docs/spec.md, with every key, its default and
what it means; `to_dict` and `from_dict` round-trip it (`models.importer.spec_toml` writes
it as TOML). A layer may name the layers it reads, `inputs = [2, 4]` (indices, names or
"input"); `add` (equal shapes, summed) and `concat` (channels side by side) merge two or more.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from netpart.errors import SpecError
from netpart.models.geometry import MERGE_KINDS, Shape, infer_shapes

__all__ = [
    "ACTIVATIONS",
    "BATCHNORM",
    "BYTES_PER_VALUE",
    "DTYPE_NAMES",
    "LAYER_KINDS",
    "MERGE_KINDS",
    "InputSpec",
    "LayerSpec",
    "ModelSpec",
    "Shape",
]

LAYER_KINDS = ("local", "conv", "dense", "pool", "lcn")
BATCHNORM = "batchnorm"  # a kind read, checked and run by the reference; not yet planned
DTYPE_NAMES = ("float32", "float64")  # what a model may run in (`reference.DTYPES`)
ACTIVATIONS = ("relu", "leaky_relu", "gelu", "silu", "sigmoid", "tanh", "none", "softmax")
DEFAULT_SLOPE = 0.01  # leaky_relu's negative slope when a spec names none (torch's default)
POOL_MODES = ("max", "avg", "l2")
SPATIAL_KINDS = ("local", "conv", "pool", "lcn")
BYTES_PER_VALUE = 4  # activations travel between workers as float32

# Keys each layer kind accepts (besides "kind").
_ALLOWED_KEYS = {
    "local": ("channels", "kernel", "stride", "padding", "activation", "negative_slope", "bias"),
    "conv": ("channels", "kernel", "stride", "padding", "activation", "negative_slope", "bias"),
    "dense": ("units", "activation", "negative_slope", "bias"),
    "pool": ("mode", "kernel", "stride", "padding", "eps"),
    "lcn": ("kernel", "eps"),
    "add": ("activation", "negative_slope"),
    "concat": ("activation", "negative_slope"),
    "batchnorm": ("eps", "momentum", "activation", "negative_slope"),
}
_INPUT = -1  # a layer's `inputs` entry for the network's input
_OPTIONAL_KEYS = ("negative_slope", "eps", "bias")  # written only when not their default


@dataclass(frozen=True)
class InputSpec:
    """The input of a network: an image (channels, height, width) or a feature vector."""

    channels: int
    height: int = 1
    width: int = 1
    flat: bool = False  # written back as {features = channels}

    @property
    def shape(self) -> Shape:
        return Shape(self.channels, self.height, self.width)

    @property
    def dims(self) -> tuple[int, ...]:
        """One example's tensor shape: (features,) or (channels, height, width)."""
        return (self.channels,) if self.flat else (self.channels, self.height, self.width)

    def to_dict(self) -> dict[str, int]:
        if self.flat:
            return {"features": self.channels}
        return {"channels": self.channels, "height": self.height, "width": self.width}


@dataclass(frozen=True)
class LayerSpec:
    """One layer. Fields that do not apply to its kind are None; defaults are filled at parse."""

    kind: str
    channels: int | None = None
    units: int | None = None
    kernel: int | tuple[int, int] | None = None  # a pair (height, width) where they differ
    stride: int | tuple[int, int] | None = None
    padding: int | tuple[int, int] = 0
    activation: str = "none"
    mode: str | None = None
    eps: float | None = None  # lcn; pool l2 (None: netpart.nn.L2_POOL_EPS)
    negative_slope: float | None = None  # leaky_relu only
    name: str | None = None  # the layer's path in the user's module (an imported spec)
    bias: bool | None = None  # local, conv, dense: False for a layer without one (None: has)
    dropout: float | None = None  # any kind: the probability an output is zeroed in training
    # the layers it reads, by index (-1: the network's input); None: the layer before it
    inputs: tuple[int, ...] | None = None
    momentum: float | None = None  # batchnorm: the running statistics' update weight

    @property
    def is_spatial(self) -> bool:
        return self.kind in SPATIAL_KINDS

    @property
    def kernel_hw(self) -> tuple[int, int]:
        """The window's (height, width)."""
        return _pair(self.kernel)

    @property
    def stride_hw(self) -> tuple[int, int]:
        return _pair(self.stride)

    @property
    def padding_hw(self) -> tuple[int, int]:
        return _pair(self.padding)

    @property
    def window(self) -> int:
        """Positions of one channel a window covers (kernel height x width)."""
        kh, kw = self.kernel_hw
        return kh * kw

    @property
    def has_bias(self) -> bool:
        """Whether a weighted layer adds a bias (every one does but those given bias = false)."""
        return self.bias is not False

    def to_dict(self) -> dict[str, Any]:
        """The layer's keys; the optional ones (`negative_slope`, a pool's `eps`) only when
        set, so a spec written before they existed keeps its fingerprint."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.name is not None:
            out["name"] = self.name
        for key in _ALLOWED_KEYS[self.kind]:
            value = getattr(self, key)
            if value is not None or key not in _OPTIONAL_KEYS:
                out[key] = list(value) if isinstance(value, tuple) else value
        if self.dropout is not None:
            out["dropout"] = self.dropout
        if self.inputs is not None:
            out["inputs"] = [i if i >= 0 else "input" for i in self.inputs]
        return out


@dataclass(frozen=True)
class ModelSpec:
    """A validated network: input, layers, and the derived per-layer output shapes."""

    name: str
    input: InputSpec
    layers: tuple[LayerSpec, ...]
    shapes: tuple[Shape, ...] = field(init=False, repr=False, compare=False)
    flats: tuple[bool, ...] = field(init=False, repr=False, compare=False)  # `is_flat`

    def __post_init__(self) -> None:
        sources = [self.sources(i) for i in range(len(self.layers))]
        shapes, flats = infer_shapes(self.input.shape, self.input.flat, self.layers, sources)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "flats", flats)
        if self.layers and self.layers[-1].dropout:
            raise SpecError(
                f"layer {len(self.layers) - 1}: dropout on the last layer would drop the "
                "model's outputs; put it on a layer below"
            )
        weighted = range(len(self.layers))
        names = [self.layers[i].name for i in weighted if self.layer_params(i)]
        names = [name for name in names if name is not None]
        if len(set(names)) < len(names):  # a layer without weights may be used twice
            again = next(n for i, n in enumerate(names) if n in names[:i])
            raise SpecError(
                f"layer name {again!r} is given to two layers with weights; each holds its "
                "own (weights shared between layers are not read)"
            )

    # ---- derived figures -------------------------------------------------------------------
    def sources(self, index: int) -> tuple[int, ...]:
        """The layers layer `index` reads, in order (-1: the network's input)."""
        inputs = self.layers[index].inputs
        return inputs if inputs is not None else (index - 1,)

    def input_layers(self, index: int) -> tuple[int, ...]:
        """The distinct layers layer `index` reads, in order of first reading (-1: the
        network's input): its input space is their outputs end to end (`input_offset`)."""
        return tuple(dict.fromkeys(self.sources(index)))

    def input_offset(self, index: int, source: int) -> int:
        """Where `source`'s units begin in layer `index`'s input space."""
        offset = 0
        for s in self.input_layers(index):
            if s == source:
                return offset
            offset += (self.input.shape if s < 0 else self.shapes[s]).size
        raise ValueError(f"layer {index} does not read {source}")

    def input_size(self, index: int) -> int:
        """Units in layer `index`'s input space (its distinct inputs' outputs end to end)."""
        return sum(
            (self.input.shape if s < 0 else self.shapes[s]).size for s in self.input_layers(index)
        )

    def input_shape(self, index: int) -> Shape:
        """The shape layer `index` reads (its first input's): the network input for layer 0."""
        first = self.sources(index)[0]
        return self.input.shape if first < 0 else self.shapes[first]

    def is_flat(self, index: int) -> bool:
        """Whether layer `index`'s output is a flat vector (a dense layer's, or a merge of
        flat ones) rather than planes."""
        return self.flats[index]

    @property
    def is_chain(self) -> bool:
        """Every layer reads the one before it, and only it."""
        return all(self.sources(i) == (i - 1,) for i in range(len(self.layers)))

    @property
    def hides_halo(self) -> bool:
        """Whether the runtime may hide a halo behind other work (split a layer, run producer
        chains, join a layer to the one below): a chain without batch norm, whose layers
        each have one reader and whose slices compute in parts."""
        return self.is_chain and all(layer.kind != BATCHNORM for layer in self.layers)

    def require_batch(self, batch: int) -> None:
        """SpecError (one line) where a batch norm would see one value per channel in a
        training step of `batch` examples (torch's BatchNorm refuses it: there is nothing to
        normalise)."""
        for i, layer in enumerate(self.layers):
            shape = self.shapes[i]
            if layer.kind == BATCHNORM and batch * shape.height * shape.width < 2:
                raise SpecError(
                    f"{self.name}: layer {i} (batchnorm) sees one value per channel in a batch "
                    f"of {batch} (as torch's BatchNorm, it cannot normalise one); use a batch "
                    "of 2 or more"
                )

    def layer_params(self, index: int) -> int:
        """Trainable parameters of layer `index` (weights and biases)."""
        layer, src, out = self.layers[index], self.input_shape(index), self.shapes[index]
        bias = int(layer.has_bias)
        if layer.kind == "local":
            return out.height * out.width * out.channels * (src.channels * layer.window + bias)
        if layer.kind == "conv":
            return out.channels * (src.channels * layer.window + bias)
        if layer.kind == "dense":
            return (src.size + bias) * layer.units
        if layer.kind == BATCHNORM:
            return 2 * src.channels  # a scale and a shift per channel (per feature: flat)
        return 0

    @property
    def num_params(self) -> int:
        return sum(self.layer_params(i) for i in range(len(self.layers)))

    @property
    def dropout_layers(self) -> tuple[int, ...]:
        """The layers with dropout, in order (`netpart.models.dropout`)."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.dropout)

    @property
    def loss(self) -> str:
        """`cross_entropy` when the last layer is softmax (trained on logits), else `mse`."""
        return "cross_entropy" if self.layers[-1].activation == "softmax" else "mse"

    def state_names(self) -> dict[str, str]:
        """The reference module's parameter names (`layers.3.weight`) -> the names they have
        in the user's module (`features.3.weight`) for the layers that carry a `name`."""
        return {
            f"layers.{i}.{param}": f"{layer.name}.{param}"
            for i, layer in enumerate(self.layers)
            if layer.name is not None and self.layer_params(i)
            for param in (("weight", "bias") if layer.has_bias else ("weight",))
        }

    def buffer_names(self) -> dict[str, str]:
        """The reference module's buffers (a batchnorm's running statistics and its count of
        batches) -> their names in the user's module, for the layers that carry a `name`."""
        return {
            f"layers.{i}.{buffer}": f"{layer.name}.{buffer}"
            for i, layer in enumerate(self.layers)
            if layer.name is not None and layer.kind == BATCHNORM
            for buffer in ("running_mean", "running_var", "num_batches_tracked")
        }

    def layer_name(self, index: int) -> str:
        return f"{index}:{self.layers[index].kind}"

    def layer_key(self, index: int) -> str:
        """What a slice's speed depends on beyond its FLOPs: the layer's kind, options and
        input and output shapes (`local 3x48x48->24x44x44 channels=24 kernel=5 ...`); layers
        of two models with equal keys run at the same rate."""
        layer = self.layers[index]
        keys = layer.to_dict().items()
        options = " ".join(f"{k}={v}" for k, v in keys if k not in ("kind", "name"))
        return f"{layer.kind} {self.input_shape(index)}->{self.shapes[index]} {options}"

    def layer_keys(self) -> list[str]:
        """Every layer's `layer_key`, in order."""
        return [self.layer_key(i) for i in range(len(self.layers))]

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input": self.input.to_dict(),
            "layer": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> ModelSpec:
        try:
            data = json.loads(text)
        except RecursionError:
            raise SpecError(f"{source}: nested too deeply to be a spec") from None
        except json.JSONDecodeError as exc:
            raise SpecError(
                f"{source}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}"
            ) from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<spec>") -> ModelSpec:
        """Parse and validate the schema above; errors name the source and the layer."""
        if not isinstance(data, dict):
            raise SpecError(
                f"{source}: a model spec must be a table/object with name, input, layer"
            )
        unknown = set(data) - {"name", "input", "layer", "layers"}
        if unknown:
            raise SpecError(
                f"{source}: unknown top-level key {sorted(unknown)[0]!r}; "
                "allowed: name, input, layer"
            )
        name = data.get("name", "unnamed")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{source}: 'name' must be a non-empty string")
        layers_raw = data.get("layer", data.get("layers"))
        if not isinstance(layers_raw, list) or not layers_raw:
            raise SpecError(f"{source}: the spec needs at least one [[layer]] table")
        inp = _parse_input(data.get("input"), source)
        layers = tuple(_parse_layer(raw, i, source) for i, raw in enumerate(layers_raw))
        layers = _resolve_inputs(layers, layers_raw, source)
        try:
            return cls(name=name, input=inp, layers=layers)
        except SpecError as exc:
            raise SpecError(f"{source}: {exc}") from None

    def fingerprint(self) -> str:
        """A digest of the architecture (input and layers, not the names of the network or
        its layers, nor their dropout, which moves no unit): plans are tied to it."""
        unplanned = ("name", "dropout")
        layers = [
            {k: v for k, v in ly.to_dict().items() if k not in unplanned} for ly in self.layers
        ]
        body = json.dumps({"input": self.input.to_dict(), "layer": layers}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


# ---- parsing ---------------------------------------------------------------------------------
def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    # netpart.nn.pair's twin: the spec is read without importing torch (planning needs none)
    return value if isinstance(value, tuple) else (value, value)


def _size(value: Any, what: str, minimum: int = 1) -> int | tuple[int, int]:
    """A kernel, stride or padding: one integer for both axes, or [height, width] (kept as
    one integer where the two are equal: a square layer's spec and fingerprint as before)."""
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise SpecError(f"{what} must be an integer or [height, width], got {value!r}")
        h, w = (_positive_int(v, what, minimum) for v in value)
        return h if h == w else (h, w)
    return _positive_int(value, what, minimum)


def _positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_input(raw: Any, source: str) -> InputSpec:
    if not isinstance(raw, dict):
        raise SpecError(
            f"{source}: 'input' must be {{channels, height, width}} or {{features}}, got {raw!r}"
        )
    try:
        if "features" in raw:
            if set(raw) != {"features"}:
                raise SpecError("input: give either features or channels/height/width, not both")
            return InputSpec(_positive_int(raw["features"], "input.features"), flat=True)
        if set(raw) != {"channels", "height", "width"}:
            raise SpecError(
                f"input: expected keys channels, height, width (or features), got {sorted(raw)}"
            )
        return InputSpec(
            _positive_int(raw["channels"], "input.channels"),
            _positive_int(raw["height"], "input.height"),
            _positive_int(raw["width"], "input.width"),
        )
    except SpecError as exc:
        raise SpecError(f"{source}: {exc}") from None


def _parse_layer(raw: Any, index: int, source: str) -> LayerSpec:
    where = f"{source}: layer {index}"
    if not isinstance(raw, dict) or "kind" not in raw:
        raise SpecError(f"{where}: each [[layer]] needs a 'kind' ({' | '.join(LAYER_KINDS)})")
    kind = raw["kind"]
    if kind not in (*LAYER_KINDS, BATCHNORM, *MERGE_KINDS):
        kinds = ", ".join((*LAYER_KINDS, BATCHNORM, *MERGE_KINDS))
        raise SpecError(f"{where}: unknown kind {kind!r}; use one of {kinds}")
    where = f"{where} ({kind})"
    allowed = _ALLOWED_KEYS[kind]
    for key in raw:
        if key not in ("kind", "name", "dropout", "inputs") and key not in allowed:
            raise SpecError(
                f"{where}: unknown key {key!r}; allowed: kind, name, dropout, inputs, "
                f"{', '.join(allowed)}"
            )
    try:
        bias = raw.get("bias", True)
        if not isinstance(bias, bool):
            raise SpecError(f"bias must be true or false, got {bias!r}")
        layer = replace(_parse_kind(raw, kind), name=_layer_name(raw.get("name")))
        dropout = _dropout(raw["dropout"]) if "dropout" in raw else None
        return replace(layer, bias=None if bias else False, dropout=dropout)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _dropout(value: Any) -> float | None:
    """A dropout probability in [0, 1) (0: none)."""
    p = _number(value, "dropout", positive=False)
    if p >= 1:
        raise SpecError(f"dropout must be below 1 (the probability a value is zeroed), got {p}")
    return p or None


def _layer_name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not all(
        p.isidentifier() or p.isdigit() for p in value.split(".")
    ):
        raise SpecError(f"name {value!r} must be a module path such as features.0 or fc1")
    return value


def _parse_kind(raw: dict, kind: str) -> LayerSpec:
    """The layer of `kind` the keys of `raw` describe."""
    if kind in ("local", "conv"):
        return LayerSpec(
            kind,
            channels=_positive_int(raw.get("channels"), "channels"),
            kernel=_size(raw.get("kernel"), "kernel"),
            stride=_size(raw.get("stride", 1), "stride"),
            padding=_size(raw.get("padding", 0), "padding", minimum=0),
            **_activation(raw),
        )
    if kind == "dense":
        return LayerSpec(kind, units=_positive_int(raw.get("units"), "units"), **_activation(raw))
    if kind == "pool":
        mode = raw.get("mode", "max")
        if mode not in POOL_MODES:
            raise SpecError(f"mode {mode!r} is not one of {', '.join(POOL_MODES)}")
        kernel = _size(raw.get("kernel"), "kernel")
        if "eps" in raw and mode != "l2":
            raise SpecError("eps applies to mode l2 only")
        return LayerSpec(
            kind,
            kernel=kernel,
            stride=_size(raw.get("stride", kernel), "stride"),
            padding=_size(raw.get("padding", 0), "padding", minimum=0),
            mode=mode,
            eps=_number(raw["eps"], "eps", positive=False) if "eps" in raw else None,
        )
    if kind in MERGE_KINDS:
        return LayerSpec(kind, **_activation({"activation": "none", **raw}))
    if kind == BATCHNORM:
        eps = _number(raw.get("eps", 1e-5), "eps", positive=True)
        momentum = _number(raw.get("momentum", 0.1), "momentum", positive=False)
        if momentum > 1:
            raise SpecError(f"momentum must be at most 1, got {momentum}")
        activation = _activation({"activation": "none", **raw})
        return LayerSpec(kind, eps=eps, momentum=momentum, **activation)
    eps = _number(raw.get("eps", 0.01), "eps", positive=True)
    return LayerSpec(kind, kernel=_positive_int(raw.get("kernel"), "kernel"), eps=eps)


def _resolve_inputs(
    layers: tuple[LayerSpec, ...], raws: list, source: str
) -> tuple[LayerSpec, ...]:
    """Each layer's `inputs` as indices of earlier layers: an index, "input" (the network's
    input) or a layer's `name` (one that no other layer carries); None where it reads the
    layer before it alone (the default). SpecError naming the layer and the input."""
    named: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if layer.name is not None:
            named.setdefault(layer.name, []).append(i)
    out = []
    for i, (layer, raw) in enumerate(zip(layers, raws, strict=True)):
        where = f"{source}: layer {i} ({layer.kind})"
        given = raw.get("inputs")
        if given is None:
            if layer.kind in MERGE_KINDS:
                raise SpecError(f"{where}: give the layers it merges, e.g. inputs = [2, 4]")
            out.append(layer)
            continue
        if not isinstance(given, list) or not given:
            raise SpecError(f"{where}: inputs is a list of layers, e.g. inputs = [2, 4]")
        inputs = tuple(_input_index(v, i, named, where) for v in given)
        if layer.kind in MERGE_KINDS and len(inputs) < 2:
            raise SpecError(f"{where}: an {layer.kind} merges two inputs or more")
        if layer.kind not in MERGE_KINDS and len(inputs) != 1:
            raise SpecError(f"{where}: a {layer.kind} layer reads one input; merge them first")
        out.append(replace(layer, inputs=None if inputs == (i - 1,) else inputs))
    return tuple(out)


def _input_index(value: Any, index: int, named: dict[str, list[int]], where: str) -> int:
    """One entry of layer `index`'s `inputs` as a layer index (-1: the network's input)."""
    if value == "input":
        return _INPUT
    if isinstance(value, str):
        found = named.get(value, [])
        if len(found) != 1:
            why = "no layer carries it" if not found else "two layers carry it"
            raise SpecError(f"{where}: input {value!r}: {why}; name a layer by its index")
        value = found[0]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < index:
        raise SpecError(
            f'{where}: input {value!r} is not an earlier layer (0 to {index - 1}) or "input"'
        )
    return value


def _number(value: Any, what: str, positive: bool) -> float:
    """A finite float > 0 (`positive`) or >= 0; SpecError otherwise."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise SpecError(
            f"{what} must be a {'positive' if positive else 'non-negative'} number, got {value!r}"
        )
    return float(value)


def _activation(raw: dict) -> dict[str, Any]:
    """A weighted layer's `activation` (default relu) and, for leaky_relu, its slope."""
    value = raw.get("activation", "relu")
    if value not in ACTIVATIONS:
        raise SpecError(f"activation {value!r} is not one of {', '.join(ACTIVATIONS)}")
    if value != "leaky_relu":
        if "negative_slope" in raw:
            raise SpecError("negative_slope applies to activation leaky_relu only")
        return {"activation": value}
    slope = raw.get("negative_slope", DEFAULT_SLOPE)
    number = isinstance(slope, int | float) and not isinstance(slope, bool)
    if not number or not math.isfinite(slope):
        raise SpecError(f"negative_slope must be a number, got {slope!r}")
    return {"activation": value, "negative_slope": float(slope)}
