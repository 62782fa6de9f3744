"""A worker's slice of a merge layer (a layer graph's `add` and `concat`): each owned unit
gathered from the layer's input space, the outputs of the layers it reads end to end."""

from __future__ import annotations

import numpy as np
import torch

from netpart.models.reference import activation
from netpart.models.spec import ModelSpec
from netpart.runtime.rows import rows
from netpart.runtime.slices import UnitSlice

__all__ = ["MergeSlice"]


class MergeSlice(UnitSlice):
    """Add and concat: each owned unit the sum of the same unit of every input (add), or the
    unit of the input whose channels hold it (concat), gathered from the input space (the
    inputs' outputs end to end)."""

    def __init__(self, spec, index, units, first=None) -> None:
        super().__init__(spec, index, units, first)
        idx = _merge_index(spec, index, self.channel, self.position)
        self._index = {p: torch.from_numpy(idx[sel]) for p, sel in self._part_units.items()}

    def _units(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return rows(x, self._index[part]).sum(dim=1)  # [U, inputs, B] -> [U, B]

    def forward_plane(self, x: list[torch.Tensor]) -> torch.Tensor:
        if self.layer.kind == "concat":
            return activation(self.layer, torch.cat(x, dim=1))
        out = x[0]
        for more in x[1:]:
            out = out + more
        return activation(self.layer, out)


def _merge_index(
    spec: ModelSpec, index: int, channel: np.ndarray, position: np.ndarray
) -> np.ndarray:
    """[U, k]: where each output unit of merge `index` reads in its input space (an add: k
    inputs; a concat: the one input holding the unit's channel)."""
    layer, columns, first = spec.layers[index], [], 0
    for source in spec.sources(index):
        shape = spec.input.shape if source < 0 else spec.shapes[source]
        at = spec.input_offset(index, source)
        if layer.kind == "add":
            columns.append(at + channel * (shape.height * shape.width) + position)
            continue
        inside = (channel >= first) & (channel < first + shape.channels)
        unit = at + (channel - first) * (shape.height * shape.width) + position
        columns = [np.where(inside, unit, columns[0])] if columns else [unit]
        first += shape.channels
    return np.stack(columns, axis=1)
