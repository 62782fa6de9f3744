"""A worker's slice of a batch norm: each channel's statistics over the batch and the whole
plane, from every worker's partial sums (one all-reduce forward, one backward), and the
running statistics kept as torch's BatchNorm keeps them."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from netpart.compile.shards import channel_groups, layer_pieces
from netpart.models.reference import activation
from netpart.runtime.rows import rows
from netpart.runtime.slices import LayerSlice

__all__ = ["BatchNormSlice", "batches_tracked", "collect_statistics", "load_statistics"]


class _AllReduceSum(torch.autograd.Function):
    """A sum over the workers of a replica, and its gradient: the sum of theirs. `owner` (a
    batch norm slice) is told that the backward's collective ran."""

    @staticmethod
    def forward(ctx, tensor, transport, owner):
        ctx.transport, ctx.owner = transport, owner
        return transport.all_reduce(tensor.detach().clone(), "sum")

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.reduced()
        return ctx.transport.all_reduce(grad.contiguous().clone(), "sum"), None, None


class BatchNormSlice(LayerSlice):
    """Batch normalisation of the owned units: in training, each channel's mean and variance
    over the batch and the whole plane, from every worker's partial sums (one all-reduce of
    [2, C] values forward, and its gradient's backward, over the replica's workers: a
    worker holding none of the layer takes part with zeros), the running statistics updated
    as torch's BatchNorm updates them; in evaluation, the running statistics. Each worker
    holding part of a channel holds its scale, shift and running statistics (the same
    values on each: they see the same sums). Never split."""

    def __init__(self, spec, index, units, blocks, seed, dtype, first=None) -> None:
        super().__init__(spec, index, units)
        del seed, first
        layer = spec.layers[index]
        self.eps, self.momentum = layer.eps, layer.momentum
        self.groups = channel_groups(spec, index, units, blocks)
        self.pieces = layer_pieces(spec, index, units, blocks, self.groups)
        sizes = [c1 - c0 for c0, c1, _, _ in self.groups]
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(n, dtype=dtype)) for n in sizes)
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes)
        held = np.concatenate([np.arange(c0, c1) for c0, c1, _, _ in self.groups] or [[]])
        self.held = held.astype(np.int64)
        self.running_mean = torch.zeros(len(held), dtype=dtype)
        self.running_var = torch.ones(len(held), dtype=dtype)
        self.num_batches_tracked = 0
        self._channel = torch.from_numpy(self.channel.astype(np.int64))
        self._local = torch.from_numpy(np.searchsorted(held, self.channel).astype(np.int64))
        self._index = torch.from_numpy(units.astype(np.int64))  # its input's units: the same
        self.channels = spec.shapes[index].channels
        self.transport = None  # the step's, set by the worker before the forward pass
        self._owes = False  # the backward's collective has not run yet
        self.set_orders({"all": [np.arange(len(units))]})

    def compute(self, x: torch.Tensor, part: str) -> list[torch.Tensor]:
        xs = rows(x, self._index)  # [U, B]
        if self.training:
            mean, var = self._batch_statistics(xs)
        else:
            mean, var = self.running_mean[self._local], self.running_var[self._local]
        if not len(self.units):
            return []
        scale = torch.cat(list(self.weights))[self._local] * torch.rsqrt(var + self.eps)
        shift = torch.cat(list(self.biases))[self._local]
        return [(xs - mean[:, None]) * scale[:, None] + shift[:, None]]

    def _batch_statistics(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each owned unit's channel's batch mean and (biased) variance, and the running
        statistics updated."""
        count = xs.shape[1] * self.hw  # values a channel holds in the replica's batch
        if count < 2:  # as torch's BatchNorm: nothing to normalise
            raise ValueError(f"layer {self.index}: one value per channel to normalise")
        local = torch.stack([xs.sum(dim=1), (xs * xs).sum(dim=1)]).to(torch.float64)
        sums = local.new_zeros(2, self.channels).index_add(1, self._channel, local)
        if self.transport is not None and self.transport.size > 1:
            sums = _AllReduceSum.apply(sums, self.transport, self)
            self._owes = True
        mean = sums[0] / count
        var = sums[1] / count - mean * mean
        with torch.no_grad():
            held = torch.from_numpy(self.held)
            m, unbiased = self.momentum, var[held] * count / max(count - 1, 1)
            self.running_mean.mul_(1 - m).add_(m * mean[held].to(self.running_mean.dtype))
            self.running_var.mul_(1 - m).add_(m * unbiased.to(self.running_var.dtype))
            self.num_batches_tracked += 1
        dtype = xs.dtype
        return mean[self._channel].to(dtype), var[self._channel].to(dtype)

    def forward_plane(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer on planes by torch's batch norm (a worker alone in its replica:
        no other worker's sums to add)."""
        if self.training:
            self.num_batches_tracked += 1
        y = F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            torch.cat(list(self.weights)),
            torch.cat(list(self.biases)),
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
        )
        return activation(self.layer, y)

    def reduced(self) -> None:
        """The backward's collective ran (`_AllReduceSum.backward`)."""
        self._owes = False

    def settle(self) -> None:
        """After this layer's backward: take part in its collective if autograd did not run
        it (a worker holding none of the layer, or none of its outputs' gradients)."""
        if self._owes:
            self.transport.all_reduce(torch.zeros(2, self.channels, dtype=torch.float64), "sum")
            self._owes = False

    def param_tensors(self):
        return [t for pair in zip(self.weights, self.biases, strict=True) for t in pair]

    def statistics(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(channel, running mean, running variance) of every channel it holds."""
        return [
            (int(c), self.running_mean[k], self.running_var[k]) for k, c in enumerate(self.held)
        ]


def collect_statistics(slices: list) -> list[tuple[str, np.ndarray, torch.Tensor]]:
    """(reference buffer name, channels, values) of the running statistics the batch norm
    slices among `slices` hold (copies)."""
    return [
        (f"layers.{s.index}.{name}", s.held, values.detach().clone())
        for s in slices
        if isinstance(s, BatchNormSlice)
        for name, values in (("running_mean", s.running_mean), ("running_var", s.running_var))
    ]


def batches_tracked(slices: list) -> dict[int, int]:
    """Each batch norm's count of batches it normalised in training, by layer."""
    return {s.index: s.num_batches_tracked for s in slices if isinstance(s, BatchNormSlice)}


def load_statistics(slices: list, state: dict[str, torch.Tensor]) -> None:
    """Set the running statistics (and counts of batches) the batch norm slices among
    `slices` hold from `state` (reference buffer name -> the whole layer's)."""
    for s in (s for s in slices if isinstance(s, BatchNormSlice)):
        held = torch.from_numpy(s.held)
        for name, mine in (("running_mean", s.running_mean), ("running_var", s.running_var)):
            full = state.get(f"layers.{s.index}.{name}")
            if full is not None:
                mine.copy_(full[held].to(mine.dtype))
        tracked = state.get(f"layers.{s.index}.num_batches_tracked")
        if tracked is not None:
            s.num_batches_tracked = int(tracked)
