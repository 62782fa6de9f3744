"""Initial weights as a pure function of (spec, seed, layer, row): numpy only, no torch.

Counter-based Philox streams keyed by (seed, layer, row) let a model worker that owns a slice
of a layer (and a parameter-server shard that holds a range of parameters) draw exactly the
reference model's values for that slice without materialising the rest.
"""

from __future__ import annotations

import math

import numpy as np

from netpart.models.spec import ModelSpec

__all__ = ["init_rows"]


def init_rows(spec: ModelSpec, seed: int, index: int, rows: np.ndarray) -> np.ndarray:
    """Initial weights of layer `index` for the given rows, float64, shape [len(rows), *row_shape].

    Local: row = output position, row shape [Cin*kh*kw, Cout]. Dense: row = output unit, row
    shape [n_in]. Conv: the single row 0, shape [Cout, Cin, kh, kw]. Values ~ N(0, 1/fan_in).
    """
    layer, src = spec.layers[index], spec.input_shape(index)
    if layer.kind == "local":
        fan_in = src.channels * layer.window
        row_shape: tuple[int, ...] = (fan_in, layer.channels)
    elif layer.kind == "dense":
        fan_in = src.size
        row_shape = (fan_in,)
    elif layer.kind == "conv":
        fan_in = src.channels * layer.window
        row_shape = (layer.channels, src.channels, *layer.kernel_hw)
    else:
        raise ValueError(f"layer {index} ({layer.kind}) has no weights")
    count = math.prod(row_shape)
    scale = 1.0 / math.sqrt(fan_in)
    out = np.empty((len(rows), count), dtype=np.float64)
    for i, row in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
        stream = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, index, row])))
        out[i] = stream.standard_normal(count)
    out *= scale
    return out.reshape((len(rows), *row_shape))
