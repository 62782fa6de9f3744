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

import itertools

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from netpart.compile.shards import (
    ParamPiece,
    channel_groups,
    layer_pieces,
    piece_index,
    piece_initial,
)
from netpart.models.reference import activation, layer_module
from netpart.models.spec import ModelSpec
from netpart.nn import L2_POOL_EPS
from netpart.partition.blocks import LayerBlocks
from netpart.partition.reads import read_window
from netpart.partition.rectangles import plane_rectangles
from netpart.runtime.rows import rows

__all__ = [
    "PLANE_KINDS",
    "ConvSlice",
    "DenseSlice",
    "LayerSlice",
    "LcnSlice",
    "LocalSlice",
    "PoolSlice",
    "UnitSlice",
    "window_index",
]

# the kinds a worker holding a whole layer runs on planes
PLANE_KINDS = ("conv", "pool", "lcn", "add", "concat", "batchnorm")


def window_index(
    spec: ModelSpec, index: int, positions: np.ndarray, channels: np.ndarray | None, pad_slot: int
) -> np.ndarray:
    """Flat input indices [len(positions), C*kh*kw] read by output positions of layer `index`.

    Order (channel, ky, kx) as in `torch.nn.functional.unfold`; reads outside the input point
    at `pad_slot`. `channels` restricts to one channel per position (pool), giving
    [Q, kh*kw].
    """
    src, out = spec.input_shape(index), spec.shapes[index]
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    y, x = np.divmod(positions, out.width)
    iy = y[:, None] * sh - ph + np.arange(kh)[None, :]  # [Q, kh]
    ix = x[:, None] * sw - pw + np.arange(kw)[None, :]  # [Q, kw]
    inside = ((iy >= 0) & (iy < src.height))[:, :, None] & ((ix >= 0) & (ix < src.width))[:, None]
    pos = iy[:, :, None] * src.width + ix[:, None, :]  # [Q, kh, kw]
    hw = src.height * src.width
    if channels is not None:
        idx = channels[:, None, None] * hw + pos
        return np.where(inside, idx, pad_slot).reshape(len(positions), kh * kw)
    idx = np.arange(src.channels)[None, :, None, None] * hw + pos[:, None]
    return np.where(inside[:, None], idx, pad_slot).reshape(len(positions), src.channels * kh * kw)


class LayerSlice(nn.Module):
    """Base: the owned `units` of layer `index`; `param_slices` maps grads into the reference.

    `compute(x, part)` returns output pieces: part "all" (every owned unit), or "first"
    (the `first` units: a layer's interior, which reads no halo, or a producer chain's early
    units) and "rest" (the others), so a worker can compute one while messages travel;
    `place(pieces, split)` puts the pieces' rows in `units` order: [len(units), B], and
    `positions[part]` are the rows' places in `units` order. Splittable slices read `x` only
    through `index_select` (which saves no view of `x`), so the rest of `x` (the halo, or the
    late units below) may be written into it between the two parts.
    """

    def __init__(self, spec: ModelSpec, index: int, units: np.ndarray) -> None:
        super().__init__()
        self.spec, self.index = spec, index
        self.units = units
        self.layer = spec.layers[index]  # its activation runs in `place`
        out = spec.shapes[index]
        self.hw = out.height * out.width
        self.channel, self.position = np.divmod(units, self.hw)
        self.n_in = spec.input_size(index)
        self.pieces: list[ParamPiece] = []
        self._orders: dict[bool, torch.Tensor] = {}  # split? -> permutation into units order
        self._in_order: dict[bool, bool] = {}  # split? -> the permutation is the identity
        self.positions: dict[str, torch.Tensor] = {}  # part -> its rows' places in units
        # Every unit of a conv, pool or LCN layer: the whole layer runs on planes
        # (`forward_plane`), as the plain module runs it.
        self.plane = len(units) == out.size and self.layer.kind in PLANE_KINDS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.place(self.compute(x, "all"), False, x)

    def forward_plane(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer (`plane`) on its input planes x [B, C, H, W], activated: its
        outputs [B, C', H', W'] by torch's own kernel, no gather and no transposes (a merge:
        `x` the list of its inputs' planes, in its inputs' order)."""
        raise NotImplementedError

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        raise NotImplementedError

    def settle(self) -> None:
        """After the layer's backward: a slice whose backward takes part in a collective
        takes part in it if autograd did not (a batch norm's); others have nothing to do."""

    def place(self, pieces: list[torch.Tensor], split: bool, x: torch.Tensor) -> torch.Tensor:
        """The pieces' rows (each [rows, ..., B]) in `units` order, activated: [len(units), B]
        (the activation runs once on the whole output, not once per piece)."""
        if not pieces:
            return x[:0]
        batch = x.shape[1]
        placed = torch.cat([p.reshape(-1, batch) for p in pieces])
        if not self._in_order[split]:  # one worker's layer, a dense slice: already in order
            placed = rows(placed, self._orders[split])
        return activation(self.layer, placed)

    def order(self, split: bool) -> torch.Tensor:
        """The permutation of the pieces' rows (all; or first then rest) into units order."""
        return self._orders[split]

    def param_tensors(self) -> list[torch.Tensor]:
        """This slice's parameter values, one tensor per piece, in the order of `pieces`
        (fetched values are copied into them)."""
        return []

    def bind_grads(self, views: list[torch.Tensor]) -> None:
        """Make backward accumulate each piece's gradient into `views` (one per piece)."""
        for t, v in zip(self.param_tensors(), views, strict=True):
            t.grad = v

    def bind_values(self, views: list[torch.Tensor]) -> None:
        """Make each piece's parameter a view of `views` (one per piece, shaped like it)."""
        for t, v in zip(self.param_tensors(), views, strict=True):
            t.data = v

    def piece_grads(self) -> list[torch.Tensor]:
        """Each piece's accumulated gradient (zeros where none), shaped like its values."""
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.param_tensors()]

    def param_slices(self) -> list[tuple[str, np.ndarray, torch.Tensor]]:
        """(reference parameter name, flat indices into it, this worker's gradient)."""
        grads = self.piece_grads()
        for piece, t in zip(self.pieces, grads, strict=True):
            if t.numel() != piece.size:
                raise ValueError(f"{piece.name}: slice holds {t.numel()}, layout {piece.size}")
        pairs = zip(self.pieces, grads, strict=True)
        return [(p.name, piece_index(self.spec, p), g) for p, g in pairs]

    def set_orders(self, placed: dict[str, list[np.ndarray]]) -> None:
        """Per part, the concatenated pieces' unit positions; per mode (split or not) the
        permutation of the pieces' rows into units order."""
        for part, where in placed.items():
            flat = np.concatenate(where) if where else np.zeros(0, dtype=np.int64)
            self.positions[part] = torch.from_numpy(flat.astype(np.int64))
        for split, parts in ((False, ("all",)), (True, ("first", "rest"))):
            if all(p in self.positions for p in parts):
                flat = torch.cat([self.positions[p] for p in parts]).numpy()
                order = np.argsort(flat, kind="stable")
                self._orders[split] = torch.from_numpy(order)
                self._in_order[split] = bool(np.array_equal(order, np.arange(len(order))))


def _first_mask(units: np.ndarray, first: np.ndarray | None) -> np.ndarray:
    """Per owned unit: is it in the first part (all False without one)."""
    if first is None:
        return np.zeros(len(units), dtype=bool)
    return np.isin(units, first)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) runs of consecutive True in `flags`."""
    padded = np.concatenate([[False], flags, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class _GroupedSlice(LayerSlice):
    """Local and conv: units grouped by the plan's channel groups, one matmul (or, conv, one
    convolution) per group and run of positions (a run keeps the weights of untied filters a
    view: no gather)."""

    def __init__(self, spec, index, units, blocks: LayerBlocks, first=None):
        super().__init__(spec, index, units)
        self.groups = channel_groups(spec, index, units, blocks)
        self.pieces = layer_pieces(spec, index, units, blocks, self.groups)
        inner = _first_mask(units, first)
        # Where each (group, position, channel) output lands in `units` order.
        self._out_index = out_index = [
            np.searchsorted(units, (np.arange(c0, c1)[None, :] * self.hw + pos[:, None]))
            for c0, c1, pos, _ in self.groups
        ]
        # Runs of positions per part: (group, a, b); "all" is one run per group.
        self._part_runs = {"all": [(g, 0, len(grp[2])) for g, grp in enumerate(self.groups)]}
        for part, want in (("first", True), ("rest", False)):
            self._part_runs[part] = [
                (g, a, b)
                for g, idx in enumerate(out_index)
                for a, b in _runs(inner[idx[:, 0]] == want)
            ]


class LocalSlice(_GroupedSlice):
    """Untied filters: per run of positions, [q, cg, K] @ [q, K, B] (batched over positions).

    Each run's weights are a leaf parameter of their own, a view of the group's values: a run
    never slices a parameter, whose backward would allocate a gradient the size of the whole
    group for every run.
    """

    def __init__(self, spec, index, units, blocks, seed, dtype, first=None) -> None:
        super().__init__(spec, index, units, blocks, first)
        self._gathers: dict[str, torch.Tensor] = {}  # per part: its runs' patches
        self._patch_index = [  # each owned position's patch: a local slice gathers them all
            torch.from_numpy(window_index(spec, index, pos, None, self.n_in))
            for _, _, pos, _ in self.groups
        ]
        self.set_orders(  # each run's rows: (position, channel)
            {
                part: [self._out_index[g][a:b].reshape(-1) for g, a, b in runs]
                for part, runs in self._part_runs.items()
            }
        )
        weights, biases = _grouped_params(spec, seed, self.pieces, dtype, local=True)
        self._per = 2 if spec.layers[index].has_bias else 1  # pieces a group: weight (bias)
        values = zip(weights, biases, strict=True) if self._per == 2 else zip(weights)
        self._values = [t.detach() for group in values for t in group]
        cuts: dict[int, set[int]] = {}  # per group, where runs of either part start and end
        for g, a, b in (r for p in ("all", "first", "rest") for r in self._part_runs[p]):
            cuts.setdefault(g, set()).update((a, b))
        self._atoms = [
            (g, a, b) for g, c in sorted(cuts.items()) for a, b in itertools.pairwise(sorted(c))
        ]
        self.run_weights = nn.ParameterList(
            nn.Parameter(self._values[self._per * g][a:b]) for g, a, b in self._atoms
        )
        if self._per == 2:
            self.run_biases = nn.ParameterList(
                nn.Parameter(self._values[2 * g + 1][a:b]) for g, a, b in self._atoms
            )
        else:  # zeros, not parameters: the layer has no bias
            self.run_biases = [biases[g][a:b] for g, a, b in self._atoms]
        self._part_atoms = {
            part: [
                k
                for g, a, b in runs
                for k, (h, c, d) in enumerate(self._atoms)
                if h == g and a <= c and d <= b
            ]
            for part, runs in self._part_runs.items()
        }

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        atoms = self._part_atoms[part]
        if not atoms:
            return []
        runs = [self._atoms[k] for k in atoms]
        patches = rows(x, self._gather_index(part, runs)).split([b - a for _, a, b in runs])
        return [
            torch.baddbmm(self.run_biases[k], self.run_weights[k], p)
            for k, p in zip(atoms, patches, strict=True)
        ]

    def param_tensors(self):
        return self._values

    def _gather_index(self, part: str, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        index = self._gathers.get(part)
        if index is None:
            index = self._gathers[part] = torch.cat([self._patch_index[g][a:b] for g, a, b in runs])
        return index

    def bind_grads(self, views: list[torch.Tensor]) -> None:
        per = self._per
        for k, (g, a, b) in enumerate(self._atoms):
            self.run_weights[k].grad = views[per * g].view_as(self._values[per * g])[a:b]
            if per == 2:
                self.run_biases[k].grad = views[2 * g + 1].view_as(self._values[2 * g + 1])[a:b]

    def bind_values(self, views: list[torch.Tensor]) -> None:
        self._values, per = list(views), self._per
        for k, (g, a, b) in enumerate(self._atoms):
            self.run_weights[k].data = views[per * g][a:b]
            if per == 2:
                self.run_biases[k].data = views[2 * g + 1][a:b]

    def piece_grads(self) -> list[torch.Tensor]:
        out, kinds = [], ((0, self.run_weights), (1, self.run_biases))[: self._per]
        for g in range(len(self.groups)):
            for kind, params in kinds:
                parts = [
                    params[k].grad if params[k].grad is not None else torch.zeros_like(params[k])
                    for k, (h, _, _) in enumerate(self._atoms)
                    if h == g
                ]
                empty = torch.zeros_like(self._values[self._per * g + kind])
                out.append(torch.cat(parts) if parts else empty)
        return out


class ConvSlice(_GroupedSlice):
    """Tied filters; each worker holds its groups' kernels. A run's positions are cut into
    rectangles of the output plane (all of it for a tile or a stripe); each rectangle of at
    least MIN_CONVOLVED positions (`netpart.partition.rectangles`) runs PyTorch's own
    convolution on the input rectangle it reads (halo and zero padding included), and the
    positions left over (an irregular cut's edges) multiply their gathered patches,
    [cg, K] @ [K, Q * B]. Each output piece is in the order torch writes it: a convolution's
    position-major ([Q * cg, B], from its channels-last output), the patches' channel-major
    ([cg, Q, B]); the placing puts the rows in units order. Each part reads `x` through one
    gather."""

    def __init__(self, spec, index, units, blocks, seed, dtype, first=None) -> None:
        super().__init__(spec, index, units, blocks, first)
        self.weights, self.biases = _grouped_params(spec, seed, self.pieces, dtype, local=False)
        self.kernel, self.stride, self.padding = read_window(spec, index)  # (height, width) each
        self.src = spec.input_shape(index)
        # per part: the gather's index, and per output piece (its groups, the input box
        # [C, h, w] they convolve or None for patches [K, Q], its output positions)
        self._reads: dict[str, tuple[torch.Tensor, list[tuple[tuple, tuple | None, int]]]] = {}
        placed = {part: self._plan_part(part, runs) for part, runs in self._part_runs.items()}
        self.set_orders(placed)  # rectangles' rows position-major, patches' channel-major

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        if part not in self._reads:
            return []
        index, pieces = self._reads[part]
        sizes = [int(np.prod(box)) if box else count * self.n_k for _, box, count in pieces]
        batch, out = x.shape[1], []
        for (groups, box, count), values in zip(pieces, rows(x, index).split(sizes), strict=True):
            if box:  # torch's convolution over the input box, channels last (oneDNN's own)
                weight, bias = self._kernels(groups)
                images = values.view(*box, batch).permute(3, 0, 1, 2)
                images = images.contiguous(memory_format=torch.channels_last)
                y = F.conv2d(images, weight, bias, stride=self.stride)
                out.append(y.permute(0, 2, 3, 1).reshape(batch, -1).t())  # [Q * channels, B]
            else:  # patches [K, Q * B]
                (g,) = groups
                y = torch.addmm(self.biases[g], self.weights[g], values.view(self.n_k, -1))
                out.append(y.view(-1, count, batch))
        return out

    def forward_plane(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._kernels(tuple(range(len(self.groups))))
        bias = bias if self.layer.has_bias else None
        y = F.conv2d(x, weight, bias, stride=self.stride, padding=self.padding)
        return activation(self.layer, y)

    def param_tensors(self):
        if not self.spec.layers[self.index].has_bias:
            return list(self.weights)
        return [t for pair in zip(self.weights, self.biases, strict=True) for t in pair]

    def _kernels(self, groups: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' kernels [channels, C, kh, kw] and biases [channels], stacked."""
        weights = [self.weights[g].view(-1, self.src.channels, *self.kernel) for g in groups]
        biases = [self.biases[g].view(-1) for g in groups]
        if len(groups) == 1:
            return weights[0], biases[0]
        return torch.cat(weights), torch.cat(biases)

    def convolved(self) -> float:
        """The share of the owned outputs torch's convolution computes (the rest: patches)."""
        pieces = self._reads["all"][1] if "all" in self._reads else []
        outputs = [
            (box is not None, count * sum(self.groups[g][1] - self.groups[g][0] for g in groups))
            for groups, box, count in pieces
        ]
        return sum(n for convolved, n in outputs if convolved) / max(sum(n for _, n in outputs), 1)

    @property
    def n_k(self) -> int:
        """Input values one output position reads (C * kh * kw)."""
        return self.src.channels * self.kernel[0] * self.kernel[1]

    def _plan_part(self, part: str, runs) -> list[np.ndarray]:
        """Cut the part's runs into rectangles and patches (`_reads`): the groups whose runs
        share a rectangle convolve it together (one read of its input box, their kernels
        stacked); return, per output piece, where its rows are in `units`."""
        if not runs:
            return []
        width, indices, pieces, where = self.spec.shapes[self.index].width, [], [], []
        shared: dict[tuple[int, int, int, int], list[int]] = {}  # rectangle -> its groups
        for g, a, b in runs:
            c0, c1, owned, _ = self.groups[g]
            positions = owned[a:b]
            rects, rest = plane_rectangles(positions, width)
            for rect in rects:
                shared.setdefault(rect, []).append(g)
            if len(rest):
                # the patches of these positions alone (a plan's rectangles need none)
                patches = window_index(self.spec, self.index, positions[rest], None, self.n_in)
                indices.append(torch.from_numpy(np.ascontiguousarray(patches.T)).reshape(-1))
                pieces.append(((g,), None, len(rest)))
                units = np.arange(c0, c1)[:, None] * self.hw + positions[rest][None, :]
                where.append(np.searchsorted(self.units, units.ravel()))  # channel-major
        for (y0, y1, x0, x1), groups in shared.items():
            box = _input_box(self.spec, self.index, (y0, y1, x0, x1), None, self.n_in)
            indices.append(box.reshape(-1))
            pieces.append((tuple(groups), tuple(box.shape), (y1 - y0) * (x1 - x0)))
            plane = (np.arange(y0, y1)[:, None] * width + np.arange(x0, x1)[None, :]).ravel()
            channels = np.concatenate([np.arange(*self.groups[g][:2]) for g in groups])
            units = plane[:, None] + channels[None, :] * self.hw
            where.append(np.searchsorted(self.units, units.ravel()))  # position-major
        self._reads[part] = (torch.cat(indices), pieces)
        return where


def _input_box(
    spec: ModelSpec,
    index: int,
    rect: tuple[int, int, int, int],
    channels: np.ndarray | None,
    pad_slot: int,
) -> torch.Tensor:
    """The input rows [c, h, w] that output rectangle (y0, y1, x0, x1) of layer `index` reads
    over `channels` (None: every input channel); reads outside the input point at
    `pad_slot`."""
    y0, y1, x0, x1 = rect
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    src = spec.input_shape(index)
    iy = np.arange(y0 * sh - ph, (y1 - 1) * sh - ph + kh)
    ix = np.arange(x0 * sw - pw, (x1 - 1) * sw - pw + kw)
    inside = ((iy >= 0) & (iy < src.height))[:, None] & ((ix >= 0) & (ix < src.width))[None, :]
    plane = iy[:, None] * src.width + ix[None, :]
    channels = np.arange(src.channels) if channels is None else channels
    idx = channels[:, None, None] * (src.height * src.width) + plane[None]
    return torch.from_numpy(np.where(inside[None], idx, pad_slot).astype(np.int64))


class DenseSlice(LayerSlice):
    """Owned neurons: [|U|, n_in] @ [n_in, B] + b (never split: a neuron reads everything)."""

    def __init__(self, spec, index, units, blocks, seed, dtype, first=None) -> None:
        super().__init__(spec, index, units)
        self.pieces = layer_pieces(spec, index, units, blocks)
        weight = _initial(spec, seed, self.pieces[0]).reshape(len(units), self.n_in)
        self.weight = nn.Parameter(torch.from_numpy(weight).to(dtype))
        zeros = torch.zeros(len(units), 1, dtype=dtype)
        self.has_bias = spec.layers[index].has_bias
        self.bias = nn.Parameter(zeros) if self.has_bias else zeros  # zeros: no bias
        self.set_orders({"all": [np.arange(len(units))]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.n_in:  # a buffer with padding rows (a joined input has none):
            x = x[: self.n_in]  # slicing adds a node to autograd's graph, so only when needed
        return activation(self.layer, torch.addmm(self.bias, self.weight, x))

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        return [self.forward(x)]

    def param_tensors(self):
        return [self.weight, self.bias] if self.has_bias else [self.weight]


class UnitSlice(LayerSlice):
    """Pool and LCN: no weights; parts are subsets of the owned units."""

    def __init__(self, spec, index, units, first=None) -> None:
        super().__init__(spec, index, units)
        inner = _first_mask(units, first)
        self._part_units = {
            "all": np.arange(len(units)),
            "first": np.flatnonzero(inner),
            "rest": np.flatnonzero(~inner),
        }
        self.set_orders({p: [u] for p, u in self._part_units.items()})
        self._module = layer_module(spec, index) if self.plane else None  # no weights

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        return [self._units(x, part)] if len(self._part_units[part]) else []

    def forward_plane(self, x: torch.Tensor) -> torch.Tensor:
        return activation(self.layer, self._module(x))


class PoolSlice(UnitSlice):
    """Per-unit windows over the unit's own channel: max, average or L2."""

    def __init__(self, spec, index, units, first=None) -> None:
        super().__init__(spec, index, units, first)
        layer = spec.layers[index]
        self.mode, self.k2 = layer.mode, layer.window
        self.eps = L2_POOL_EPS if layer.eps is None else layer.eps  # l2
        pad = self.n_in + 1 if self.mode == "max" else self.n_in
        idx = window_index(spec, index, self.position, self.channel, pad)
        self._index = {p: torch.from_numpy(idx[sel]) for p, sel in self._part_units.items()}

    def _units(self, x: torch.Tensor, part: str) -> torch.Tensor:
        win = rows(x, self._index[part])  # [U, k*k, B]
        if self.mode == "max":  # ties: the first in the window takes the gradient, as in
            return win.max(dim=1).values  # torch's max_pool2d (amax would share it)
        if self.mode == "avg":
            return win.sum(dim=1) / self.k2
        return torch.sqrt((win * win).sum(dim=1) + self.eps)


class LcnSlice(UnitSlice):
    """(x - mean) / sqrt(var + eps), mean and var over the k x k window and all channels.

    As in the reference: average over channels first, then over each unit's window of
    positions. A part gathers only the positions its units' windows cover.
    """

    def __init__(self, spec, index, units, first=None) -> None:
        super().__init__(spec, index, units, first)
        src = spec.input_shape(index)
        self.eps = spec.layers[index].eps
        hw = src.height * src.width
        self._gathers = {}
        for part, sel in self._part_units.items():
            positions, pos_of_unit = np.unique(self.position[sel], return_inverse=True)
            zeros = np.zeros(len(positions), dtype=np.int64)  # channel 0: flat index = position
            window = window_index(spec, index, positions, zeros, hw)  # [P, k*k], pad = hw
            covered = np.unique(window[window < hw])
            local = np.searchsorted(covered, np.minimum(window, hw - 1))
            local = np.where(window < hw, local, len(covered))  # pad -> the zero row
            channels = np.arange(src.channels)[None, :] * hw + covered[:, None]  # [P', C]
            self._gathers[part] = tuple(
                torch.from_numpy(a)
                for a in (channels, local, pos_of_unit.reshape(-1), self.units[sel])
            )

    def _units(self, x: torch.Tensor, part: str) -> torch.Tensor:
        channels, window, pos_of_unit, centre = self._gathers[part]
        planes = rows(x, channels)  # [P', C, B]
        pad = planes.new_zeros(1, planes.shape[-1])
        mean_c = torch.cat([planes.mean(dim=1), pad])  # [P' + 1, B], last row = zero padding
        sq_c = torch.cat([(planes * planes).mean(dim=1), pad])
        mean = rows(rows(mean_c, window).mean(dim=1), pos_of_unit)  # [U, B]
        var = rows(rows(sq_c, window).mean(dim=1), pos_of_unit) - mean * mean
        return (rows(x, centre) - mean) / torch.sqrt(var + self.eps)


def _initial(spec: ModelSpec, seed: int | None, piece: ParamPiece) -> np.ndarray:
    """The reference's initial values; with seed None a constant (float32, no random draws:
    for timing slices of models too large to initialise quickly)."""
    if seed is None:
        return np.full(piece.size, 0.01, dtype=np.float32)
    return piece_initial(spec, seed, piece)


def _grouped_params(
    spec: ModelSpec, seed: int | None, pieces: list[ParamPiece], dtype: torch.dtype, local: bool
) -> tuple[nn.ParameterList, nn.ParameterList]:
    """Weights ([Q, cg, K] local, [cg, K] conv) and zero biases of the groups' pieces (weight
    and bias, or weight alone: then the biases are zeros, not parameters)."""
    weights, biases = nn.ParameterList(), nn.ParameterList()
    bias = bool(pieces) and spec.layers[pieces[0].layer].has_bias
    zeros = []
    for w in pieces[:: 2 if bias else 1]:
        cg = w.c1 - w.c0
        shape = (len(w.rows), cg, -1) if local else (cg, -1)
        values = torch.from_numpy(_initial(spec, seed, w)).reshape(shape)
        weights.append(nn.Parameter(values.to(dtype)))
        bias_shape = (len(w.rows), cg, 1) if local else (cg, 1)
        zeros.append(torch.zeros(bias_shape, dtype=dtype))
    if not bias:
        return weights, zeros
    biases.extend(nn.Parameter(z) for z in zeros)
    return weights, biases
