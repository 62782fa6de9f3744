"""Rows of units-major tensors ([units, batch]): gathered, written and added by index.

A worker's buffers hold one row of B values per unit; its slices gather input rows and its
messages take and put rows. `rows` gathers through `index_select` (several times faster than
advanced indexing here, forward and backward); `RowIndex` takes a contiguous range as a view
and writes it in place, with no gather or scatter at all.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["RowIndex", "rows"]


def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a (possibly 2-D) row index: index_select on the flat index, then a view.

    Faster than advanced indexing, forward and backward (index_add).
    """
    return torch.index_select(x, 0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


class RowIndex:
    """Sorted rows of a units-major tensor: one contiguous range is taken as a view and
    written in place (no gather, no scatter); other sets through index_select/index_copy."""

    def __init__(self, index: np.ndarray) -> None:
        self.index = torch.from_numpy(np.asarray(index, dtype=np.int64))
        n = len(index)
        whole = n == 0 or int(index[-1]) - int(index[0]) + 1 == n
        self.span = (int(index[0]) if n else 0, int(index[-1]) + 1 if n else 0) if whole else None

    def __len__(self) -> int:
        return len(self.index)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x[rows]: a view when contiguous."""
        if self.span is not None:
            return x[self.span[0] : self.span[1]]
        return rows(x, self.index)

    def view_in(self, x: torch.Tensor) -> torch.Tensor | None:
        """The rows as a writable view of `x`, or None when they are not contiguous."""
        return None if self.span is None else x[self.span[0] : self.span[1]]

    def put_(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        if self.span is not None:
            buf[self.span[0] : self.span[1]].copy_(src)
        else:
            buf.index_copy_(0, self.index, src)

    def add_(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        if self.span is not None:
            buf[self.span[0] : self.span[1]].add_(src)
        else:
            buf.index_add_(0, self.index, src)
