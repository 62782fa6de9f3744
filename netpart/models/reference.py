"""The single-process reference model: the plain `nn.Module` every partitioned run must equal.

Initial weights come from `netpart.models.init.init_rows` (Philox streams keyed by seed, layer
and row), so a model worker that owns a slice of a layer draws exactly the reference's values
for it. A "row" is one output position of a locally connected layer (its `[K, out]` filter
bank), one output unit of a dense layer, or the whole of a conv. Biases start at zero.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from netpart.models.dropout import DropoutKey, keep_scale
from netpart.models.init import init_rows
from netpart.models.spec import DTYPE_NAMES, LayerSpec, ModelSpec
from netpart.nn import L2Pool2d, LocalContrastNorm, LocallyConnected2d

__all__ = [
    "DTYPES",
    "Add",
    "Concat",
    "Pool2d",
    "ReferenceModel",
    "activation",
    "build_reference",
    "dropout_mask",
    "exported_program",
    "layer_module",
    "reference_loss",
]

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the one table of them


def activation(layer: LayerSpec, x: torch.Tensor) -> torch.Tensor:
    """Apply `layer`'s activation (torch's own function for each); softmax is left to the
    loss, which takes logits."""
    name = layer.activation
    if name == "relu":
        return torch.relu(x)
    if name == "leaky_relu":
        return F.leaky_relu(x, layer.negative_slope)
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "tanh":
        return torch.tanh(x)
    return x  # none, and softmax (the loss takes logits)


class Pool2d(nn.Module):
    """Per-channel max or average (zero padding counted) pooling; L2 is `netpart.nn.L2Pool2d`."""

    def __init__(self, layer: LayerSpec) -> None:
        super().__init__()
        self.mode, self.kernel = layer.mode, layer.kernel_hw
        self.stride, self.padding = layer.stride_hw, layer.padding_hw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s, (ph, pw) = self.kernel, self.stride, self.padding
        if ph or pw:  # explicit padding: torch's pools limit padding to half the kernel
            fill = float("-inf") if self.mode == "max" else 0.0
            x = F.pad(x, (pw, pw, ph, ph), value=fill)
        if self.mode == "max":
            return F.max_pool2d(x, k, s)
        return F.avg_pool2d(x, k, s)


class _Dense(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(1))


class Add(nn.Module):
    """The sum of its inputs (a residual addition)."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out


class Concat(nn.Module):
    """Its inputs' channels side by side (dim 1), in order."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs, dim=1)


def layer_module(spec: ModelSpec, index: int) -> nn.Module:
    """Layer `index` of `spec` as a plain module on [B, C, H, W] (dense: any shape, flattened),
    its activation and dropout left out: the reference's, and a model worker's where it
    computes a whole layer (`netpart.runtime.slices`)."""
    layer, src, out = spec.layers[index], spec.input_shape(index), spec.shapes[index]
    if layer.kind == "local":
        size = (src.height, src.width)
        return LocallyConnected2d(
            src.channels,
            out.channels,
            size,
            layer.kernel,
            layer.stride,
            layer.padding,
            bias=layer.has_bias,
        )
    if layer.kind == "conv":
        return nn.Conv2d(
            src.channels,
            out.channels,
            layer.kernel,
            layer.stride,
            layer.padding,
            bias=layer.has_bias,
        )
    if layer.kind == "dense":
        return _Dense(src.size, layer.units, bias=layer.has_bias)
    if layer.kind == "pool" and layer.mode == "l2":
        eps = {} if layer.eps is None else {"eps": layer.eps}
        return L2Pool2d(layer.kernel, layer.stride, layer.padding, **eps)
    if layer.kind == "pool":
        return Pool2d(layer)
    if layer.kind == "batchnorm":
        norm = nn.BatchNorm1d if spec.is_flat(index) else nn.BatchNorm2d
        return norm(src.channels, eps=layer.eps, momentum=layer.momentum)
    if layer.kind == "add":
        return Add()
    if layer.kind == "concat":
        return Concat()
    return LocalContrastNorm(layer.kernel, layer.eps)


class ReferenceModel(nn.Module):
    """The whole network in one process, its layers in order, each reading the layers its
    spec names (`ModelSpec.sources`); `forward` returns the last layer's pre-softmax output."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(layer_module(spec, i) for i in range(len(spec.layers)))

    def forward(self, x: torch.Tensor, dropout: DropoutKey | None = None) -> torch.Tensor:
        """The outputs of a batch; `dropout`: a training step's key (its layers' dropout on,
        the masks every split draws too); None: no dropout (evaluation, export)."""
        x = x.reshape(x.shape[0], *self.spec.input.dims)
        outs: list[torch.Tensor] = []
        for i, (layer, mod) in enumerate(zip(self.spec.layers, self.layers, strict=True)):
            y = activation(layer, mod(*(x if s < 0 else outs[s] for s in self.spec.sources(i))))
            if layer.dropout and dropout is not None:
                y = y * dropout_mask(self.spec, i, len(y), dropout, y.dtype)
            outs.append(y)
        return outs[-1]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return reference_loss(self.spec, outputs, targets)


def dropout_mask(
    spec: ModelSpec, index: int, batch: int, key: DropoutKey, dtype: torch.dtype
) -> torch.Tensor:
    """Layer `index`'s dropout mask for a batch, batch-first in the layer's output shape
    ([B, C, H, W], or [B, units]): the reference's, and a user module's in `check`."""
    shape = spec.shapes[index]
    units = torch.arange(shape.size)
    mask = keep_scale(spec.layers[index].dropout, index, units, batch, key, dtype).T
    if spec.is_flat(index):
        return mask
    return mask.reshape(batch, shape.channels, shape.height, shape.width)


def reference_loss(spec: ModelSpec, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy on logits (a softmax last layer) or mean squared error: the loss
    of `spec`'s outputs, from whichever module computed them."""
    if spec.loss == "cross_entropy":
        return F.cross_entropy(outputs.flatten(1), targets)
    return F.mse_loss(outputs.flatten(1), targets.flatten(1))


@torch.no_grad()
def build_reference(
    spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32
) -> ReferenceModel:
    """The single-process model with the deterministic initial weights of (spec, seed)."""
    model = ReferenceModel(spec).to(dtype)
    for i, (layer, mod) in enumerate(zip(spec.layers, model.layers, strict=True)):
        if layer.kind == "local":
            rows = np.arange(mod.weight.shape[0])
        elif layer.kind in ("dense", "conv"):
            rows = np.arange(mod.weight.shape[0] if layer.kind == "dense" else 1)
        else:
            continue
        values = torch.from_numpy(init_rows(spec, seed, i, rows))
        mod.weight.copy_(values.reshape(mod.weight.shape))
        if mod.bias is not None:
            mod.bias.zero_()
    return model


class _Standardised(nn.Module):
    """The model after (x - mean) / std: an image folder's model takes pixels in [0, 1]."""

    def __init__(self, model: nn.Module, mean: float, std: float) -> None:
        super().__init__()
        self.model, self.mean, self.std = model, mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)


def exported_program(
    spec: ModelSpec, state: dict[str, torch.Tensor], standardised: tuple[float, float] | None
):
    """The reference module with `state` loaded, as a `torch.export` program whose batch
    size is free: plain PyTorch loads it with `torch.export.load(path).module()` and calls
    it on float32 inputs [batch, C, H, W] (or [batch, features]) for the logits. With
    `standardised` (mean, std: an image folder's), it takes the images' pixels in [0, 1] and
    standardises them as training did."""
    model: nn.Module = ReferenceModel(spec)
    model.load_state_dict(state)
    model = model.float().eval()
    if standardised is not None:
        model = _Standardised(model, *standardised)
    example = torch.zeros(2, *spec.input.dims)
    batch = torch.export.Dim("batch", min=1)
    return torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
