"""How a layer is cut into blocks: the granularity of the cut and each layer's block grid.

A block is a box of one layer's units (a channel group x a row band x a column band); the unit
graph (`netpart.partition.graph`) takes blocks as its vertices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from netpart.models.spec import Shape

__all__ = ["Granularity", "LayerBlocks", "even_bounds"]


@dataclass(frozen=True)
class Granularity:
    """How finely layers are cut into blocks.

    Spatial layers get at least `spatial_blocks` blocks where their units allow: near-square tiles
    first, channel groups only when a layer has fewer positions than that. Dense layers get
    `min(units, dense_blocks)` equal groups of neurons: a dense block reads the whole previous
    layer, so more dense blocks add edges but no partitioning freedom; a multiple of the worker
    count balances them exactly. `max_blocks` caps any layer (keeps graphs tractable).
    With `align_pools`, the input of a pool with non-overlapping windows is cut where the
    pool's blocks read: its bands are stride x the pool's (split further where the layer wants
    more blocks), its channel groups the pool's unless that would make the layer's blocks many
    more than it wants (a reader of all channels reads every group), and units no pool window
    reads form bands of their own. Where the channel groups agree, every such input block is
    read by exactly one pool block.
    """

    spatial_blocks: int = 64
    dense_blocks: int = 16
    max_blocks: int = 16384
    align_pools: bool = False

    @classmethod
    def for_workers(
        cls, workers: int, blocks_per_worker: int = 24, align_pools: bool = False
    ) -> Granularity:
        """The default for a plan over `workers`: enough blocks to balance every layer."""
        return cls(
            spatial_blocks=max(256, blocks_per_worker * workers),
            dense_blocks=workers * max(2, math.ceil(16 / workers)),
            align_pools=align_pools,
        )

    def grid(self, shape: Shape, dense: bool) -> tuple[int, int, int]:
        """(nc, ny, nx) for a layer of this output shape."""
        if dense:
            return min(shape.channels, self.dense_blocks, self.max_blocks), 1, 1
        h, w = shape.height, shape.width
        tile = max(1, math.isqrt((h * w) // max(1, self.spatial_blocks)))
        while math.ceil(h / tile) * math.ceil(w / tile) > self.max_blocks:
            tile += 1
        ny, nx = math.ceil(h / tile), math.ceil(w / tile)
        nc = 1
        if ny * nx < self.spatial_blocks:
            nc = min(shape.channels, math.ceil(self.spatial_blocks / (ny * nx)))
            nc = max(1, min(nc, self.max_blocks // (ny * nx)))
        return nc, ny, nx

    def to_dict(self) -> dict[str, int]:
        return {
            "spatial_blocks": self.spatial_blocks,
            "dense_blocks": self.dense_blocks,
            "max_blocks": self.max_blocks,
            "align_pools": self.align_pools,
        }


def even_bounds(n: int, parts: int) -> np.ndarray:
    return (np.arange(parts + 1, dtype=np.int64) * n) // parts


@dataclass(frozen=True, eq=False)
class LayerBlocks:
    """The block grid of one layer: ids `first .. first+count`, ordered (group, row, column)."""

    index: int
    kind: str
    shape: Shape
    cbounds: np.ndarray
    ybounds: np.ndarray
    xbounds: np.ndarray
    first: int

    @property
    def nc(self) -> int:
        return len(self.cbounds) - 1

    @property
    def ny(self) -> int:
        return len(self.ybounds) - 1

    @property
    def nx(self) -> int:
        return len(self.xbounds) - 1

    @property
    def count(self) -> int:
        return self.nc * self.ny * self.nx

    @property
    def ids(self) -> np.ndarray:
        return np.arange(self.first, self.first + self.count)

    def owner_grid(self, node_map: np.ndarray) -> np.ndarray:
        """Worker owning each unit of this layer, as a [nc, H, W] grid over channel groups."""
        owners = node_map[self.first : self.first + self.count].reshape(self.nc, self.ny, self.nx)
        ty = np.repeat(np.arange(self.ny), np.diff(self.ybounds))
        tx = np.repeat(np.arange(self.nx), np.diff(self.xbounds))
        return owners[:, ty][:, :, tx]
