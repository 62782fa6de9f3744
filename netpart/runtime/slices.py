"""A worker's slice of one layer: its parameters and the dense computation of its units.

Buffers are units-major: a slice reads a full-size input buffer `x` of shape [N_in + 2, B] in
which the worker has filled the units it owns and the halo it received (other rows stay zero
and are never read); row N_in holds 0 (zero padding) and row N_in + 1 holds -inf (max-pool
padding). It returns its owned units as [len(units), B] in the order of `units` (sorted flat
indices of the layer's (C, H, W) output). Gathers copy whole rows of B contiguous values, and
locally connected layers run as one batched matmul [Q, cg, K] @ [Q, K, B] per channel group.
Computation never loops over units; the only Python loops are over the plan's channel groups.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from netpart.models.reference import L2_POOL_EPS, activation
from netpart.models.spec import ModelSpec
from netpart.partition.graph import LayerBlocks, read_window
from netpart.partition.shards import (
    ParamPiece,
    channel_groups,
    layer_pieces,
    piece_index,
    piece_initial,
)

__all__ = ["LayerSlice", "build_slice", "rows", "window_index"]


def window_index(
    spec: ModelSpec, index: int, positions: np.ndarray, channels: np.ndarray | None, pad_slot: int
) -> np.ndarray:
    """Flat input indices [len(positions), C*k*k] read by output positions of layer `index`.

    Order (channel, ky, kx) as in `torch.nn.functional.unfold`; reads outside the input point
    at `pad_slot`. `channels` restricts to one channel per position (pool), giving [Q, k*k].
    """
    src, out = spec.input_shape(index), spec.shapes[index]
    k, s, p = read_window(spec, index)
    y, x = np.divmod(positions, out.width)
    iy = y[:, None] * s - p + np.arange(k)[None, :]  # [Q, k]
    ix = x[:, None] * s - p + np.arange(k)[None, :]
    inside = ((iy >= 0) & (iy < src.height))[:, :, None] & ((ix >= 0) & (ix < src.width))[:, None]
    pos = iy[:, :, None] * src.width + ix[:, None, :]  # [Q, k, k]
    hw = src.height * src.width
    if channels is not None:
        idx = channels[:, None, None] * hw + pos
        return np.where(inside, idx, pad_slot).reshape(len(positions), k * k)
    idx = np.arange(src.channels)[None, :, None, None] * hw + pos[:, None]
    return np.where(inside[:, None], idx, pad_slot).reshape(len(positions), src.channels * k * k)


def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a (possibly 2-D) row index: index_select on the flat index, then a view.

    Several times faster than advanced indexing here, forward and backward (index_add).
    """
    return torch.index_select(x, 0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


class LayerSlice(nn.Module):
    """Base: the owned `units` of layer `index`; `param_slices` maps grads into the reference."""

    def __init__(self, spec: ModelSpec, index: int, units: np.ndarray) -> None:
        super().__init__()
        self.spec, self.index = spec, index
        self.units = units
        self.activation = spec.layers[index].activation
        out = spec.shapes[index]
        self.hw = out.height * out.width
        self.channel, self.position = np.divmod(units, self.hw)
        self.n_in = spec.input_shape(index).size
        self.pieces: list[ParamPiece] = []

    def param_tensors(self) -> list[nn.Parameter]:
        """This slice's parameters in the order of `pieces`."""
        return []

    def param_slices(self) -> list[tuple[str, np.ndarray, nn.Parameter]]:
        """(reference parameter name, flat indices into it, this worker's parameter)."""
        tensors = self.param_tensors()
        for piece, t in zip(self.pieces, tensors, strict=True):
            if t.numel() != piece.size:
                raise ValueError(f"{piece.name}: slice holds {t.numel()}, layout {piece.size}")
        pairs = zip(self.pieces, tensors, strict=True)
        return [(p.name, piece_index(self.spec, p), t) for p, t in pairs]


class _GroupedSlice(LayerSlice):
    """Local and conv: units grouped by the plan's channel groups, one matmul per group."""

    def __init__(self, spec: ModelSpec, index: int, units: np.ndarray, blocks: LayerBlocks):
        super().__init__(spec, index, units)
        self.groups = channel_groups(spec, index, units, blocks)
        self.pieces = layer_pieces(spec, index, units, blocks, self.groups)
        # Where each (group, position, channel) output lands in `units` order.
        self._out_index = [
            torch.from_numpy(
                np.searchsorted(units, (np.arange(c0, c1)[None, :] * self.hw + pos[:, None]))
            )
            for c0, c1, pos, _ in self.groups
        ]
        self._patch_index = [
            torch.from_numpy(window_index(spec, index, pos, None, self.n_in))
            for _, _, pos, _ in self.groups
        ]
        self._order = (
            torch.from_numpy(np.argsort(np.concatenate([o.reshape(-1) for o in self._out_index])))
            if self.groups
            else torch.zeros(0, dtype=torch.long)
        )

    def _place(self, parts: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rows of each group's [Q, cg, B] output, put in `units` order: [len(units), B]."""
        if not parts:
            return x[:0]
        return rows(torch.cat([p.reshape(-1, x.shape[1]) for p in parts]), self._order)


class LocalSlice(_GroupedSlice):
    """Untied filters: per group, [Q, cg, K] @ [Q, K, B] (batched over owned positions)."""

    def __init__(self, spec, index, units, blocks, seed: int | None, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units, blocks)
        self.weights, self.biases = _grouped_params(spec, seed, self.pieces, dtype, local=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [
            torch.baddbmm(b, w, rows(x, pidx))  # [Q, cg, B]
            for w, b, pidx in zip(self.weights, self.biases, self._patch_index, strict=True)
        ]
        return activation(self.activation, self._place(parts, x))

    def param_tensors(self):
        return [t for pair in zip(self.weights, self.biases, strict=True) for t in pair]


class ConvSlice(_GroupedSlice):
    """Tied filters: per group, [Q*B, K] @ [K, cg]; each worker holds its groups' kernels."""

    def __init__(self, spec, index, units, blocks, seed: int | None, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units, blocks)
        self.weights, self.biases = _grouped_params(spec, seed, self.pieces, dtype, local=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [
            torch.matmul(w, rows(x, pidx)) + b  # [cg, K] @ [Q, K, B] -> [Q, cg, B]
            for w, b, pidx in zip(self.weights, self.biases, self._patch_index, strict=True)
        ]
        return activation(self.activation, self._place(parts, x))

    def param_tensors(self):
        return [t for pair in zip(self.weights, self.biases, strict=True) for t in pair]


class DenseSlice(LayerSlice):
    """Owned neurons: [|U|, n_in] @ [n_in, B] + b."""

    def __init__(self, spec, index, units, blocks, seed: int | None, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units)
        self.pieces = layer_pieces(spec, index, units, blocks)
        weight = _initial(spec, seed, self.pieces[0]).reshape(len(units), self.n_in)
        self.weight = nn.Parameter(torch.from_numpy(weight).to(dtype))
        self.bias = nn.Parameter(torch.zeros(len(units), 1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.activation, torch.addmm(self.bias, self.weight, x[: self.n_in]))

    def param_tensors(self):
        return [self.weight, self.bias]


class PoolSlice(LayerSlice):
    """Per-unit windows over the unit's own channel: max, average or L2."""

    def __init__(self, spec, index, units) -> None:
        super().__init__(spec, index, units)
        layer = spec.layers[index]
        self.mode, self.k2 = layer.mode, layer.kernel**2
        pad = self.n_in + 1 if self.mode == "max" else self.n_in
        idx = window_index(spec, index, self.position, self.channel, pad)
        self._index = torch.from_numpy(idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        win = rows(x, self._index)  # [U, k*k, B]
        if self.mode == "max":
            return win.amax(dim=1)
        if self.mode == "avg":
            return win.sum(dim=1) / self.k2
        return torch.sqrt((win * win).sum(dim=1) + L2_POOL_EPS)


class LcnSlice(LayerSlice):
    """(x - mean) / sqrt(var + eps), mean and var over the k x k window and all channels.

    As in the reference: average over channels first (one pass over the input), then over
    each owned position's window of positions.
    """

    def __init__(self, spec, index, units) -> None:
        super().__init__(spec, index, units)
        src = spec.input_shape(index)
        self.eps, self.c_in, self.hw_in = (
            spec.layers[index].eps,
            src.channels,
            src.height * src.width,
        )
        positions, pos_of_unit = np.unique(self.position, return_inverse=True)
        zeros = np.zeros(len(positions), dtype=np.int64)  # channel 0: flat index = position
        self._window = torch.from_numpy(window_index(spec, index, positions, zeros, self.hw_in))
        self._pos_of_unit = torch.from_numpy(pos_of_unit.reshape(-1))
        self._centre = torch.from_numpy(self.units)  # same size: input unit = output unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        planes = x[: self.n_in].reshape(self.c_in, self.hw_in, -1)
        pad = x.new_zeros(1, x.shape[1])
        mean_c = torch.cat([planes.mean(dim=0), pad])  # [HW + 1, B], last row = zero padding
        sq_c = torch.cat([(planes * planes).mean(dim=0), pad])
        mean = rows(rows(mean_c, self._window).mean(dim=1), self._pos_of_unit)  # [U, B]
        var = rows(rows(sq_c, self._window).mean(dim=1), self._pos_of_unit) - mean * mean
        return (rows(x, self._centre) - mean) / torch.sqrt(var + self.eps)


def _initial(spec: ModelSpec, seed: int | None, piece: ParamPiece) -> np.ndarray:
    """The reference's initial values; with seed None a constant (float32, no random draws:
    for timing slices of models too large to initialise quickly)."""
    if seed is None:
        return np.full(piece.size, 0.01, dtype=np.float32)
    return piece_initial(spec, seed, piece)


def _grouped_params(
    spec: ModelSpec, seed: int | None, pieces: list[ParamPiece], dtype: torch.dtype, local: bool
) -> tuple[nn.ParameterList, nn.ParameterList]:
    """Weights ([Q, cg, K] local, [cg, K] conv) and zero biases of (weight, bias) piece pairs."""
    weights, biases = nn.ParameterList(), nn.ParameterList()
    for w, b in zip(pieces[::2], pieces[1::2], strict=True):
        cg = w.c1 - w.c0
        shape = (len(w.rows), cg, -1) if local else (cg, -1)
        values = torch.from_numpy(_initial(spec, seed, w)).reshape(shape)
        weights.append(nn.Parameter(values.to(dtype)))
        bias_shape = (len(b.rows), cg, 1) if local else (cg, 1)
        biases.append(nn.Parameter(torch.zeros(bias_shape, dtype=dtype)))
    return weights, biases


def build_slice(
    spec: ModelSpec,
    index: int,
    units: np.ndarray,
    blocks: LayerBlocks,
    seed: int | None,
    dtype: torch.dtype,
) -> LayerSlice:
    """The slice of layer `index` holding `units`, with the reference's initial weights
    (constant ones with `seed` None)."""
    kind = spec.layers[index].kind
    if kind == "local":
        return LocalSlice(spec, index, units, blocks, seed, dtype)
    if kind == "conv":
        return ConvSlice(spec, index, units, blocks, seed, dtype)
    if kind == "dense":
        return DenseSlice(spec, index, units, blocks, seed, dtype)
    if kind == "pool":
        return PoolSlice(spec, index, units)
    return LcnSlice(spec, index, units)
