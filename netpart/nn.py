"""The DistBelief layers PyTorch lacks, as plain `nn.Module`s a user composes with torch's own:
`LocallyConnected2d` (untied weights: each output position has its own filters),
`LocalContrastNorm` and `L2Pool2d`. They are netpart's reference for those layer kinds: the
single-process reference model (`netpart.models.reference`) is built from them, and every
partitioned step is checked against it.

    from torch import nn
    from netpart.nn import LocallyConnected2d, L2Pool2d, LocalContrastNorm

    model = nn.Sequential(
        LocallyConnected2d(3, 8, (32, 32), kernel_size=5), nn.ReLU(),
        L2Pool2d(2), LocalContrastNorm(5),
        nn.Flatten(), nn.Linear(8 * 14 * 14, 10),
    )

Windows, strides and paddings are one integer for both axes or (height, width), as torch's
own layers take them (LocalContrastNorm's window is square).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["L2_POOL_EPS", "L2Pool2d", "LocalContrastNorm", "LocallyConnected2d", "out_size", "pair"]

L2_POOL_EPS = 1e-6  # sqrt(sum x^2 + eps): keeps the gradient finite where a window is all zero


Size = int | tuple[int, int]


def pair(value: Size) -> tuple[int, int]:
    """(height, width) of a size given as one integer for both or as the pair."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Positions a window of `kernel` at `stride` over `size` padded by `padding` takes."""
    return (size + 2 * padding - kernel) // stride + 1


class LocallyConnected2d(nn.Module):
    """Untied filters: out[n, o, y, x] = sum_k W[y*Wo+x, k, o] * patch[n, k, y, x] + b[o, y, x].

    `in_size` is the input's (height, width): untied filters are one bank a position, so the
    layer knows its plane. Patches are gathered units-major, [L*K, N] rows of the input's
    [C*H*W + 1, N] transpose (the last row zero: the padding), as netpart's partitioned slices
    gather them (`F.unfold`'s patches [N, K, L] would need a transposed copy for the batched
    matmul over positions).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        in_size: Size,
        kernel_size: Size,
        stride: Size = 1,
        padding: Size = 0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        (h, w), (kh, kw), (sh, sw), (ph, pw) = map(pair, (in_size, kernel_size, stride, padding))
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.out_shape = (out_channels, out_size(h, kh, sh, ph), out_size(w, kw, sw, pw))
        _, oh, ow = self.out_shape
        fan_in = in_channels * kh * kw
        self.weight = nn.Parameter(torch.empty(oh * ow, fan_in, out_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels, oh, ow)) if bias else None
        # each patch's input rows, in unfold's (channel, ky, kx) order; size: the padding.
        # Always on the CPU: a model built on the meta device for its shapes alone (an
        # exported state_dict's) would otherwise run unfold's decompositions there, whose
        # imports cost seconds.
        size = in_channels * h * w
        ids = torch.arange(1, size + 1, dtype=torch.float64, device="cpu")
        ids = ids.reshape(1, in_channels, h, w)
        rows = F.unfold(ids, (kh, kw), padding=(ph, pw), stride=(sh, sw))[0]
        rows = torch.where(rows > 0, rows - 1, size).long().t().reshape(-1)  # [L*K]
        self.register_buffer("rows", rows, persistent=False)
        bound = fan_in**-0.5  # as torch's Linear and Conv2d start: U(-1/sqrt(fan_in), ...)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, (positions, fan_in, _) = x.shape[0], self.weight.shape
        units = torch.cat([x.reshape(n, -1).t(), x.new_zeros(1, n)])  # [C*H*W + 1, N]
        patches = units.index_select(0, self.rows).view(positions, fan_in, n)
        y = torch.bmm(patches.transpose(1, 2), self.weight)  # [L, N, out]
        c, oh, ow = self.out_shape
        y = y.permute(1, 2, 0).reshape(n, c, oh, ow)
        return y if self.bias is None else y + self.bias


class L2Pool2d(nn.Module):
    """Per-channel L2 pooling: sqrt(sum of x^2 over the window + eps), zero padding counted
    (netpart's `pool` of mode `l2`; torch's `LPPool2d(2)` is eps 0 without padding)."""

    def __init__(
        self,
        kernel_size: Size,
        stride: Size | None = None,
        padding: Size = 0,
        eps: float = L2_POOL_EPS,
    ) -> None:
        super().__init__()
        self.kernel_size, self.padding, self.eps = kernel_size, padding, eps
        self.stride = kernel_size if stride is None else stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), s, (ph, pw) = pair(self.kernel_size), pair(self.stride), pair(self.padding)
        if ph or pw:  # explicit padding: torch's pools limit padding to half the kernel
            x = F.pad(x, (pw, pw, ph, ph))
        return torch.sqrt(F.avg_pool2d(x * x, (kh, kw), s) * (kh * kw) + self.eps)


class LocalContrastNorm(nn.Module):
    """y = (x - m) / sqrt(v + eps); m, v = mean and variance over a k x k window (k odd) and
    every channel. Windows are zero padded at the border (the zeros count), so the output
    has the input's size."""

    def __init__(self, kernel_size: int, eps: float = 0.01) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"LocalContrastNorm's kernel_size must be odd, not {kernel_size}")
        self.kernel_size, self.eps = kernel_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        mean = F.avg_pool2d(x.mean(1, keepdim=True), k, 1, k // 2, count_include_pad=True)
        sq = F.avg_pool2d((x * x).mean(1, keepdim=True), k, 1, k // 2, count_include_pad=True)
        return (x - mean) / torch.sqrt(sq - mean * mean + self.eps)
