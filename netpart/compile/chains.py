"""Producer chains: a worker computes the units its peers read first, so their halo travels
while it computes the rest.

A halo that a layer receives can only hide behind that layer's own interior units. When that
interior is small (an LCN over a pool), the halo can instead hide behind the layers that
*produce* it: worker w computes, in the layers below a message, only the units the message's
values depend on (the *early* units), posts the message, and then computes the rest (the
*late* units). Backward mirrors it: the late units' gradients are complete before any peer's
gradient arrives (no peer reads them), so w computes their backward while the peer's
gradients for the early units travel.

A chain is a run of layers a..b of one worker such that w sends units of layer b at layer
b + 1, and no layer of the run receives a halo for w, reads everything below it (dense), or
exchanges anything besides (only layer a may send). Its early units: at b, the units w sends;
below, the owned units the early units above read; in a conv or local layer, every owned unit
at a position of one of them (its slice computes a position's channels in one matmul). The
chain stops below the first layer whose early units are all of its owned units (nothing would
be left to compute meanwhile).
"""

from __future__ import annotations

import numpy as np

from netpart.models.spec import ModelSpec
from netpart.partition.reads import read_window

__all__ = ["producer_chains", "units_read"]


def units_read(spec: ModelSpec, index: int, units: np.ndarray) -> np.ndarray:
    """The sorted units of layer `index - 1` that `units` (of layer `index`) read.

    A unit reads a rectangle of the input plane (one channel for a pool, all channels
    otherwise); the rectangles are summed with a 2-D difference table, not looped over.
    Dense layers read everything.
    """
    src, out = spec.input_shape(index), spec.shapes[index]
    if len(units) == 0:
        return np.zeros(0, dtype=np.int64)
    if not spec.layers[index].is_spatial:
        return np.arange(src.size, dtype=np.int64)
    (kh, kw), (sh, sw), (ph, pw) = read_window(spec, index)
    c, yx = np.divmod(np.asarray(units, dtype=np.int64), out.height * out.width)
    y, x = np.divmod(yx, out.width)
    y0, y1 = np.clip(y * sh - ph, 0, src.height), np.clip(y * sh - ph + kh, 0, src.height)
    x0, x1 = np.clip(x * sw - pw, 0, src.width), np.clip(x * sw - pw + kw, 0, src.width)
    pool = spec.layers[index].kind == "pool"
    ch = c if pool else np.zeros_like(c)
    diff = np.zeros((src.channels if pool else 1, src.height + 1, src.width + 1), np.int64)
    for yy, xx, sign in ((y0, x0, 1), (y0, x1, -1), (y1, x0, -1), (y1, x1, 1)):
        np.add.at(diff, (ch, yy, xx), sign)
    cover = diff.cumsum(axis=1).cumsum(axis=2)[:, : src.height, : src.width] > 0
    if not pool:
        cover = np.broadcast_to(cover, (src.channels, src.height, src.width))
    return np.flatnonzero(cover)


def producer_chains(
    spec: ModelSpec,
    owned: tuple[tuple[np.ndarray, ...], ...],
    sends: tuple[dict[tuple[int, int], np.ndarray], ...],
    flops: np.ndarray,
    min_flops: float,
    split: tuple[bool, ...] = (),
) -> tuple[tuple[tuple[np.ndarray, ...], ...], tuple[tuple[tuple[int, int], ...], ...]]:
    """(early[layer][worker], chains[worker]): each worker's chains (a, b), lowest layer
    first, and their early units (sorted; empty outside chains). A chain is kept only when
    its late units hold at least `min_flops` of work per example, and the layer whose halo it
    hides is in `split` (any, when empty)."""
    layers, workers = len(owned), len(owned[0])
    early = [[owned[layer][w][:0] for w in range(workers)] for layer in range(layers)]
    chains: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    for w in range(workers):
        for message in range(layers - 1, 0, -1):
            if split and not split[message]:
                continue
            found = _chain(spec, owned, sends, w, message)
            late = sum(flops[lay, w] * (1 - len(e) / len(owned[lay][w])) for lay, e in found)
            if not found or late < min_flops:
                continue
            for lay, units in found:
                early[lay][w] = units
            chains[w].append((found[-1][0], found[0][0]))
        chains[w].sort()
    return (
        tuple(tuple(row) for row in early),
        tuple(tuple(c) for c in chains),
    )


def _chain(spec, owned, sends, w: int, message: int) -> list[tuple[int, np.ndarray]]:
    """[(layer, early units)] from layer `message - 1` down, for the units w sends there."""
    sent = [u for (s, _), u in sends[message].items() if s == w]
    if not sent:
        return []
    want = np.unique(np.concatenate(sent))
    found: list[tuple[int, np.ndarray]] = []
    layer = message - 1
    while layer >= 0:
        receives = any(d == w for (_, d) in sends[layer])
        if spec.layers[layer].kind == "dense" or receives:
            break
        mine = owned[layer][w]
        want = _whole_positions(spec, layer, want, mine)
        if not 0 < len(want) < len(mine):  # all needed first: nothing to hide behind
            break
        found.append((layer, want))
        if layer == 0 or any(w in pair for pair in sends[layer]):
            break
        want = np.intersect1d(units_read(spec, layer, want), owned[layer - 1][w])
        layer -= 1
    return found


def _whole_positions(spec: ModelSpec, layer: int, want: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """`want` (owned units of `layer`) grown to every owned unit at its positions when the layer
    is conv or local: their slices split a layer by positions, never by channels."""
    if spec.layers[layer].kind not in ("conv", "local"):
        return want
    shape = spec.shapes[layer]
    plane = shape.height * shape.width
    return mine[np.isin(mine % plane, want % plane)]
