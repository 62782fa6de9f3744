"""Which slice computes a layer: `build_slice`, one worker's part of any layer kind."""

from __future__ import annotations

import numpy as np
import torch

from netpart.models.spec import ModelSpec
from netpart.partition.blocks import LayerBlocks
from netpart.runtime.batchnorm import BatchNormSlice
from netpart.runtime.merges import MergeSlice
from netpart.runtime.slices import (
    ConvSlice,
    DenseSlice,
    LayerSlice,
    LcnSlice,
    LocalSlice,
    PoolSlice,
)

__all__ = ["build_slice"]


def build_slice(
    spec: ModelSpec,
    index: int,
    units: np.ndarray,
    blocks: LayerBlocks,
    seed: int | None,
    dtype: torch.dtype,
    first: np.ndarray | None = None,
) -> LayerSlice:
    """The slice of layer `index` holding `units`, with the reference's initial weights
    (constant ones with `seed` None); `first` (a subset of `units`) enables its parts."""
    kind = spec.layers[index].kind
    if kind == "local":
        return LocalSlice(spec, index, units, blocks, seed, dtype, first)
    if kind == "conv":
        return ConvSlice(spec, index, units, blocks, seed, dtype, first)
    if kind == "dense":
        return DenseSlice(spec, index, units, blocks, seed, dtype, first)
    if kind == "pool":
        return PoolSlice(spec, index, units, first)
    if kind in ("add", "concat"):
        return MergeSlice(spec, index, units, first)
    if kind == "batchnorm":
        return BatchNormSlice(spec, index, units, blocks, seed, dtype, first)
    return LcnSlice(spec, index, units, first)
