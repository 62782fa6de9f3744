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

from netpart.models.reference import L2_POOL_EPS, activation, init_rows
from netpart.models.spec import ModelSpec
from netpart.partition.graph import LayerBlocks, read_window

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

    def param_slices(self) -> list[tuple[str, np.ndarray, nn.Parameter]]:
        """(reference parameter name, flat indices into it, this worker's parameter)."""
        return []


class _GroupedSlice(LayerSlice):
    """Local and conv: units grouped by the plan's channel groups, one matmul per group."""

    def __init__(self, spec: ModelSpec, index: int, units: np.ndarray, blocks: LayerBlocks):
        super().__init__(spec, index, units)
        group = np.searchsorted(blocks.cbounds, self.channel, side="right") - 1
        self.groups: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        for g in np.unique(group):
            c0, c1 = int(blocks.cbounds[g]), int(blocks.cbounds[g + 1])
            sel = np.nonzero(group == g)[0]
            positions = np.unique(self.position[sel])
            # Each owned block covers whole channel groups, so every position in this group
            # holds all channels c0..c1: rows of the output are (position, channel).
            assert len(sel) == len(positions) * (c1 - c0), "blocks must hold whole groups"
            self.groups.append((c0, c1, positions, sel))
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

    def __init__(self, spec, index, units, blocks, seed: int, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units, blocks)
        self.k_in = spec.input_shape(index).channels * spec.layers[index].kernel ** 2
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for c0, c1, pos, _ in self.groups:
            rows = init_rows(spec, seed, index, pos)[:, :, c0:c1].transpose(0, 2, 1)  # [Q, cg, K]
            self.weights.append(
                nn.Parameter(torch.from_numpy(np.ascontiguousarray(rows)).to(dtype))
            )
            self.biases.append(nn.Parameter(torch.zeros(len(pos), c1 - c0, 1, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [
            torch.baddbmm(b, w, rows(x, pidx))  # [Q, cg, B]
            for w, b, pidx in zip(self.weights, self.biases, self._patch_index, strict=True)
        ]
        return activation(self.activation, self._place(parts, x))

    def param_slices(self):
        out = []
        cout = self.spec.shapes[self.index].channels
        for (c0, c1, pos, _), w, b in zip(self.groups, self.weights, self.biases, strict=True):
            ch = np.arange(c0, c1)
            k = np.arange(self.k_in)
            w_idx = (pos[:, None, None] * self.k_in + k[None, None, :]) * cout + ch[None, :, None]
            b_idx = ch[None, :] * self.hw + pos[:, None]
            name = f"layers.{self.index}"
            out += [(f"{name}.weight", w_idx.ravel(), w), (f"{name}.bias", b_idx.ravel(), b)]
        return out


class ConvSlice(_GroupedSlice):
    """Tied filters: per group, [Q*B, K] @ [K, cg]; each worker holds its groups' kernels."""

    def __init__(self, spec, index, units, blocks, seed: int, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units, blocks)
        full = init_rows(spec, seed, index, np.array([0]))[0]  # [Cout, Cin, k, k]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for c0, c1, _, _ in self.groups:
            kernel = np.ascontiguousarray(full[c0:c1].reshape(c1 - c0, -1))  # [cg, K]
            self.weights.append(nn.Parameter(torch.from_numpy(kernel).to(dtype)))
            self.biases.append(nn.Parameter(torch.zeros(c1 - c0, 1, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [
            torch.matmul(w, rows(x, pidx)) + b  # [cg, K] @ [Q, K, B] -> [Q, cg, B]
            for w, b, pidx in zip(self.weights, self.biases, self._patch_index, strict=True)
        ]
        return activation(self.activation, self._place(parts, x))

    def param_slices(self):
        out = []
        k_in = self.weights[0].shape[1] if len(self.weights) else 0
        for (c0, c1, _, _), w, b in zip(self.groups, self.weights, self.biases, strict=True):
            ch = np.arange(c0, c1)
            # reference weight [Cout, Cin, k, k] flattened: c * K + k; ours is [cg, K].
            w_idx = ch[:, None] * k_in + np.arange(k_in)[None, :]
            name = f"layers.{self.index}"
            out += [(f"{name}.weight", w_idx.ravel(), w), (f"{name}.bias", ch, b)]
        return out


class DenseSlice(LayerSlice):
    """Owned neurons: [|U|, n_in] @ [n_in, B] + b."""

    def __init__(self, spec, index, units, seed: int, dtype: torch.dtype) -> None:
        super().__init__(spec, index, units)
        rows = init_rows(spec, seed, index, units)  # [|U|, n_in]
        self.weight = nn.Parameter(torch.from_numpy(rows).to(dtype))
        self.bias = nn.Parameter(torch.zeros(len(units), 1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.activation, torch.addmm(self.bias, self.weight, x[: self.n_in]))

    def param_slices(self):
        n_in = self.n_in
        w_idx = self.units[:, None] * n_in + np.arange(n_in)[None, :]
        name = f"layers.{self.index}"
        return [
            (f"{name}.weight", w_idx.ravel(), self.weight),
            (f"{name}.bias", self.units, self.bias),
        ]


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


def build_slice(
    spec: ModelSpec,
    index: int,
    units: np.ndarray,
    blocks: LayerBlocks,
    seed: int,
    dtype: torch.dtype,
) -> LayerSlice:
    """The slice of layer `index` holding `units`, with the reference's initial weights."""
    kind = spec.layers[index].kind
    if kind == "local":
        return LocalSlice(spec, index, units, blocks, seed, dtype)
    if kind == "conv":
        return ConvSlice(spec, index, units, blocks, seed, dtype)
    if kind == "dense":
        return DenseSlice(spec, index, units, seed, dtype)
    if kind == "pool":
        return PoolSlice(spec, index, units)
    return LcnSlice(spec, index, units)
