"""Layer geometry: the shape every layer of a spec outputs, from its input's and its own
windows (`window_output`), or from the inputs it merges (`add`: equal shapes; `concat`:
channels side by side); SpecError, one line, for geometry that cannot exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netpart.errors import SpecError

__all__ = ["MERGE_KINDS", "Shape", "infer_shapes", "window_output"]

MERGE_KINDS = ("add", "concat")  # layers that read several: a sum, or channels side by side


@dataclass(frozen=True)
class Shape:
    """An activation shape per example: channels x height x width (dense: units x 1 x 1)."""

    channels: int
    height: int
    width: int

    @property
    def size(self) -> int:
        return self.channels * self.height * self.width

    def __str__(self) -> str:
        if self.height == self.width == 1:
            return f"{self.channels}"
        return f"{self.channels}x{self.height}x{self.width}"


def window_output(layer: Any, src: Shape, where: str, *, skips: bool = False) -> Shape:
    """The output shape of a windowed layer (local, conv, pool) on `src`; SpecError naming
    the axis where a stride, padding or kernel does not fit. A stride above the kernel (inputs
    between windows never read) is taken where `skips` (a layer graph: a residual block's 1x1,
    stride-2 projection); a chain's planner assumes every unit is read."""
    sizes = []
    for axis, k, s, p, n in zip(
        ("height", "width"),
        layer.kernel_hw,
        layer.stride_hw,
        layer.padding_hw,
        (src.height, src.width),
        strict=True,
    ):
        square = all(isinstance(v, int) for v in (layer.kernel, layer.stride, layer.padding))
        across = "" if square else f" ({axis})"
        if s > k and not skips:
            raise SpecError(
                f"{where}: stride {s} is larger than kernel {k}{across}, so inputs between "
                "windows would never be read; use stride <= kernel"
            )
        if p >= k:
            raise SpecError(f"{where}: padding {p} must be smaller than kernel {k}{across}")
        if k > n + 2 * p:
            raise SpecError(
                f"{where}: kernel {k}{across} is larger than its input {src.height}x{src.width}"
                f"{f' padded by {p}' if p else ''}; use a smaller kernel or more padding"
            )
        sizes.append((n + 2 * p - k) // s + 1)
    channels = layer.channels if layer.kind in ("local", "conv") else src.channels
    return Shape(channels, *sizes)


def infer_shapes(
    shape: Shape, flat_input: bool, layers: Sequence[Any], sources: Sequence[tuple[int, ...]]
) -> tuple[tuple[Shape, ...], tuple[bool, ...]]:
    """Output shape of every layer (`LayerSpec`s reading `sources`, -1 the input of `shape`,
    a flat vector where `flat_input`), and whether each output is a flat vector (a dense
    layer's, or a merge or batch norm of flat ones) rather than planes; SpecError for
    geometry that cannot exist."""
    shapes: list[Shape] = []
    flat: list[bool] = []  # each layer's output is a flat vector
    n = len(layers)
    skips = any(reads != (i - 1,) for i, reads in enumerate(sources))  # a layer graph
    read_by: set[int] = set()
    for i, layer in enumerate(layers):
        where = f"layer {i} ({layer.kind})"
        if layer.activation == "softmax" and (i != n - 1 or layer.kind != "dense"):
            raise SpecError(f"{where}: softmax is only allowed on the last layer, a dense one")
        read_by.update(sources[i])
        srcs = [shape if s < 0 else shapes[s] for s in sources[i]]
        flats = [flat_input if s < 0 else flat[s] for s in sources[i]]
        if layer.kind in MERGE_KINDS:
            out = _merged(layer.kind, sources[i], srcs, flats, where)
            flat.append(flats[0])
        elif layer.kind == "batchnorm":  # its input's shape, per channel
            out = srcs[0]
            flat.append(flats[0])
        elif layer.kind == "dense":
            out = Shape(layer.units, 1, 1)
            flat.append(True)
        else:
            src = srcs[0]
            if flats[0]:
                raise SpecError(
                    f"{where}: a spatial layer needs an image input, but its input is a flat "
                    "vector (after a dense layer or a features input); move it before the dense "
                    "layers"
                )
            if layer.kind == "lcn":
                if (k := layer.kernel) % 2 == 0:
                    raise SpecError(f"{where}: lcn kernel must be odd (same-size output), got {k}")
                out = Shape(src.channels, src.height, src.width)
            else:
                out = window_output(layer, src, where, skips=skips)
            flat.append(False)
        shapes.append(out)
    unread = [i for i in range(n - 1) if i not in read_by]
    if unread:
        raise SpecError(
            f"layer {unread[0]} ({layers[unread[0]].kind}): no layer reads its output; "
            "the last layer is the model's output, every other one feeds a layer"
        )
    return tuple(shapes), tuple(flat)


def _merged(
    kind: str, sources: tuple[int, ...], srcs: list[Shape], flats: list[bool], where: str
) -> Shape:
    """The output of an `add` (shapes equal) or a `concat` (channels side by side, planes
    equal) of `srcs`; SpecError naming the two inputs that do not fit."""

    def name(k: int) -> str:
        s = sources[k]
        return f"{'the input' if s < 0 else f'layer {s}'} ({srcs[k]})"

    for k in range(1, len(srcs)):
        if flats[k] != flats[0]:
            raise SpecError(f"{where}: {name(0)} and {name(k)}: one is flat, the other an image")
        if kind == "add" and srcs[k] != srcs[0]:
            raise SpecError(f"{where}: {name(0)} and {name(k)} differ; an add needs equal shapes")
        if kind == "concat" and (srcs[k].height, srcs[k].width) != (srcs[0].height, srcs[0].width):
            raise SpecError(
                f"{where}: {name(0)} and {name(k)} differ in height or width; a concat joins "
                "channels of equal planes"
            )
    if kind == "add":
        return srcs[0]
    return Shape(sum(s.channels for s in srcs), srcs[0].height, srcs[0].width)
