"""Overlap: what splitting a layer hides of its halo, what the split costs, and which layers
to split.

With workers on machines of their own the runtime can split a layer that receives a halo:
forward, it computes the layer's interior units (those that read no halo) while the halo
travels, then the rest; backward, it sends the input gradients before computing the weight
gradients; and where the layers below a halo form a producer chain
(`netpart.compile.chains`), it computes the units its peers read first and the rest while
they travel, both ways. What can hide an exchange is that work (`hiding`).

A split is not free: its parts are smaller kernels and more calls, a chain's outputs are put
back in order, and the transport's threads run between the parts on the same core. On
emulated dedicated machines the work a split runs beside a halo grew by about `SPLIT_COST`
of itself (docs/measurements.md), so splitting every layer that can made the step slower
than not splitting at 1 Gbit/s, and faster at 100 Mbit/s for some layers only. A layer is
split only when what it hides, summed over the workers, exceeds what it costs
(`choose_splits`); the plan records the choice per layer (`LayerFigures.split`), the
programs follow it (`netpart.compile.schedule`) and the prediction prices it (`apply`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SPLIT_COST", "SPLIT_MIN_FLOPS", "apply", "choose_splits", "hiding"]

SPLIT_MIN_FLOPS = 1e6  # per example: below it a split's calls cost what they hide
SPLIT_COST = 0.4  # of the work a split runs beside a halo, added by splitting


def hiding(flops, work, share, recv, kinds, interior, chains) -> tuple[np.ndarray, np.ndarray]:
    """([L, P], [L, P]): the work that can run while each worker's forward and backward
    exchange of each layer travels, were the layer split. `flops` [L, P] per example, `work`
    [L, P] seconds, `share` [L, 1] the forward share of work, `recv` [L, P] values received,
    `interior` [L, P] the share of units that read no halo, `chains` (late, feeds) [L, P]."""
    big = (flops >= SPLIT_MIN_FLOPS) & (recv > 0)
    big[0] = False
    kind = np.array(kinds if kinds is not None else ["dense"] * len(flops))[:, None]
    split = big & (kind != "dense") & (interior > 0) & (interior < 1)
    hide_fwd = np.where(split, interior * work * share, 0.0)
    weights = big & np.isin(kind, ("local", "conv", "dense"))
    hide_bwd = np.where(weights, work * (1.0 - share) / 2.0, 0.0)
    if chains is None:
        return hide_fwd, hide_bwd
    return _chain_hiding(chains, flops, work, share, hide_fwd, hide_bwd)


def _chain_hiding(chains, flops, work, share, hide_fwd, hide_bwd):
    """Add to each exchange the late work of the producer chain below it (forward: its
    forward share; backward: the rest), where that work reaches SPLIT_MIN_FLOPS."""
    late, feeds = chains
    at = feeds >= 0
    rows, cols = np.nonzero(at)
    late_flops = np.zeros_like(hide_fwd)
    np.add.at(late_flops, (feeds[at], cols), (flops * late)[at])
    worth = late_flops[feeds[at], cols] >= SPLIT_MIN_FLOPS
    rows, cols, top = rows[worth], cols[worth], feeds[at][worth]
    fwd, bwd = hide_fwd.copy(), hide_bwd.copy()
    np.add.at(fwd, (top, cols), (work * late * share)[rows, cols])
    np.add.at(bwd, (top, cols), (work * late * (1.0 - share))[rows, cols])
    return fwd, bwd


def choose_splits(phase, hide_fwd, hide_bwd, split_cost: float) -> np.ndarray:
    """[L] bool: the layers whose split pays. A split hides of each direction's exchange
    (`phase` [L, P], one direction) at most the work beside it and costs `split_cost` of
    that work; a layer is split when, over its workers, it hides more than it costs."""
    gain = np.minimum(phase, hide_fwd) + np.minimum(phase, hide_bwd)
    cost = split_cost * (hide_fwd + hide_bwd)
    return (gain - cost).sum(axis=1) > 0


def apply(split, work, share, hide_fwd, hide_bwd, split_cost: float):
    """(work, share, hide_fwd, hide_bwd) [L, P] with the choice `split` [L] made: nothing
    hidden in a layer not split; a split layer's work grows by its cost (forward and backward
    each by theirs, so the forward share moves)."""
    keep = np.asarray(split, dtype=bool)[:, None]
    hide_fwd, hide_bwd = np.where(keep, hide_fwd, 0.0), np.where(keep, hide_bwd, 0.0)
    fwd = work * share + split_cost * hide_fwd
    total = work + split_cost * (hide_fwd + hide_bwd)
    share = np.divide(fwd, total, out=np.broadcast_to(share, work.shape).copy(), where=total > 0)
    return total, share, hide_fwd, hide_bwd
