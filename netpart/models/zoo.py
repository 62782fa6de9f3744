"""The model zoo and `load_spec`, which reads a zoo name, a TOML file or a JSON file.

Zoo models follow the DistBelief paper (Dean et al., 2012): `speech` is its fully connected
acoustic model (440 inputs, 4 x 2560 sigmoid, 8192-way softmax, ~42M parameters); the
`image-*` models are locally connected nets on 100x100 RGB input with three stages of
10x10 untied filtering + L2 pooling + local contrast normalisation, sized to 80M, 330M and
1.7B parameters (the largest with a 21841-way output, as for ImageNet-21k). The
benchmark models: `digits-mlp` (64-256-256-10, the data-parallel comparison's job on
scikit-learn's digits) and `bench-local` / `bench-local-wide` (mid-size locally connected
nets, 10M and 32M parameters, on 3x48x48 input, for the runtime and calibration figures);
`cifar-cnn` (two 3x3 conv layers with max pooling on 3x32x32 input: calibration times its
slices for the conv kind's tables, both torch's convolution and gathered patches). The
residual networks `resnet-20` (CIFAR, 3x32x32, projection shortcuts) and `resnet-50`
(torchvision's, 3x224x224) are layer graphs with batch normalisation: read and checked, not
yet planned.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from netpart.errors import SpecError
from netpart.models import importer  # torch is imported only when a module is read
from netpart.models.spec import ModelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ZOO", "load_spec", "zoo_names"]


def _image(name: str, c1: int, c2: int, c3: int, classes: int) -> dict[str, Any]:
    layers: list[dict[str, Any]] = []
    for channels in (c1, c2, c3):
        layers += [
            {"kind": "local", "channels": channels, "kernel": 10, "stride": 1},
            {"kind": "pool", "mode": "l2", "kernel": 2, "stride": 2},
            {"kind": "lcn", "kernel": 5},
        ]
    layers.append({"kind": "dense", "units": classes, "activation": "softmax"})
    return {"name": name, "input": {"channels": 3, "height": 100, "width": 100}, "layer": layers}


def _bench_local(name: str, c1: int, c2: int) -> dict[str, Any]:
    return {
        "name": name,
        "input": {"channels": 3, "height": 48, "width": 48},
        "layer": [
            {"kind": "local", "channels": c1, "kernel": 5},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "lcn", "kernel": 5},
            {"kind": "local", "channels": c2, "kernel": 5},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    }


def _resnet(name: str, size: int, widths: tuple[int, ...], blocks: tuple[int, ...]) -> dict:
    """He et al.'s residual network as torchvision writes it, its layers named as there (so a
    state_dict loads into that class): at 224 the ImageNet stem (7x7/2 conv, 3x3/2 max pool)
    and bottleneck blocks (1x1, 3x3 with the stride, 1x1 to 4x the width); at 32 the CIFAR
    stem (3x3 conv) and basic blocks (two 3x3, the first with the stride). A block whose shape
    changes adds a 1x1 projection (conv, batch norm) of its input; global average pooling, a
    dense classifier."""
    layers: list[dict[str, Any]] = []

    def put(kind: str, where: str | None = None, **keys: Any) -> int:
        layers.append({"kind": kind, **({"name": where} if where else {}), **keys})
        return len(layers) - 1

    def conv(where: str, channels: int, kernel: int, stride: int = 1, **extra: Any) -> int:
        padding = kernel // 2
        keys = {"channels": channels, "kernel": kernel, "stride": stride, "padding": padding}
        return put("conv", where, **keys, bias=False, activation="none", **extra)

    imagenet = size == 224
    conv("conv1", widths[0], 7 if imagenet else 3, 2 if imagenet else 1)
    x = put("batchnorm", "bn1", activation="relu")
    if imagenet:
        x = put("pool", "maxpool", mode="max", kernel=3, stride=2, padding=1)
    channels = widths[0]
    for s, (width, count) in enumerate(zip(widths, blocks, strict=True)):
        out = width * 4 if imagenet else width
        for b in range(count):
            stride, block = (2 if s and not b else 1), f"layer{s + 1}.{b}"
            if imagenet:
                conv(f"{block}.conv1", width, 1)
                put("batchnorm", f"{block}.bn1", activation="relu")
                conv(f"{block}.conv2", width, 3, stride)
                put("batchnorm", f"{block}.bn2", activation="relu")
                conv(f"{block}.conv3", out, 1)
                body = put("batchnorm", f"{block}.bn3")
            else:
                conv(f"{block}.conv1", width, 3, stride)
                put("batchnorm", f"{block}.bn1", activation="relu")
                conv(f"{block}.conv2", width, 3)
                body = put("batchnorm", f"{block}.bn2")
            shortcut = x
            if stride != 1 or channels != out:
                conv(f"{block}.downsample.0", out, 1, stride, inputs=[x])
                shortcut = put("batchnorm", f"{block}.downsample.1")
            x = put("add", inputs=[body, shortcut], activation="relu")
            channels = out
    plane = size // (32 if imagenet else 4)
    put("pool", "avgpool", mode="avg", kernel=plane)
    put("dense", "fc", units=1000 if imagenet else 10, activation="softmax")
    return {"name": name, "input": {"channels": 3, "height": size, "width": size}, "layer": layers}


_ZOO_DICTS: dict[str, dict[str, Any]] = {
    "tiny-mlp": {
        "name": "tiny-mlp",
        "input": {"features": 64},
        "layer": [
            {"kind": "dense", "units": 32, "activation": "tanh"},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    },
    "tiny-local": {
        "name": "tiny-local",
        "input": {"channels": 1, "height": 16, "width": 16},
        "layer": [
            {"kind": "local", "channels": 8, "kernel": 3, "stride": 1, "activation": "relu"},
            {"kind": "pool", "mode": "max", "kernel": 2, "stride": 2},
            {"kind": "lcn", "kernel": 3},
            {"kind": "local", "channels": 8, "kernel": 3, "stride": 1, "activation": "relu"},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    },
    "speech": {
        "name": "speech",
        "input": {"features": 440},
        "layer": [{"kind": "dense", "units": 2560, "activation": "sigmoid"}] * 4
        + [{"kind": "dense", "units": 8192, "activation": "softmax"}],
    },
    "digits-mlp": {
        "name": "digits-mlp",
        "input": {"features": 64},
        "layer": [
            {"kind": "dense", "units": 256, "activation": "relu"},
            {"kind": "dense", "units": 256, "activation": "relu"},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    },
    "cifar-cnn": {
        "name": "cifar-cnn",
        "input": {"channels": 3, "height": 32, "width": 32},
        "layer": [
            {"kind": "conv", "channels": 32, "kernel": 3, "padding": 1, "activation": "relu"},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "conv", "channels": 64, "kernel": 3, "padding": 1, "activation": "relu"},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    },
    "resnet-20": _resnet("resnet-20", 32, (16, 32, 64), (3, 3, 3)),
    "resnet-50": _resnet("resnet-50", 224, (64, 128, 256, 512), (3, 4, 6, 3)),
    "bench-local": _bench_local("bench-local", 24, 32),
    "bench-local-wide": _bench_local("bench-local-wide", 48, 64),
    "image-80m": _image("image-80m", 12, 24, 48, 1000),
    "image-330m": _image("image-330m", 32, 48, 96, 1000),
    "image-1.7b": _image("image-1.7b", 64, 144, 224, 21841),
}

ZOO: dict[str, ModelSpec] = {
    name: ModelSpec.from_dict(d, f"zoo:{name}") for name, d in _ZOO_DICTS.items()
}


def zoo_names() -> list[str]:
    return list(ZOO)


def load_spec(name_or_path: str | Path, *, input: str | None = None) -> ModelSpec:
    """A zoo name, a path to a `.toml` or `.json` spec, or a user's `nn.Module`
    ('FILE.py:NAME' or 'package.module:NAME', read at one example's shape `input`: see
    `netpart.models.importer`); raises SpecError naming the problem."""
    key = str(name_or_path)
    if key in ZOO:
        return ZOO[key]
    if importer.is_module_target(key):
        return importer.import_target(key, input)
    path = Path(key)
    if not path.exists():
        if path.suffix in (".toml", ".json"):
            raise SpecError(f"{key}: no such file")
        close = difflib.get_close_matches(key, list(ZOO), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SpecError(
            f"unknown model {key!r}: {hint}not a zoo model ({', '.join(ZOO)}) nor a .toml/.json "
            "file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{key}: cannot read: {exc}") from None
    if path.suffix == ".json":
        return ModelSpec.from_json(text, key)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{key}: malformed TOML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{key}: nested too deeply to be a spec") from None
    return ModelSpec.from_dict(data, key)
