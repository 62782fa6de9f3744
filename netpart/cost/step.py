"""The step-time model: each worker's own timeline through the layers, joined by the halos.

Per layer l and worker w: compute(l, w) = FLOPs of w's blocks of l (forward + backward) x
batch / worker FLOP/s (the `Machine`'s figures, `netpart.cost.machine`), and exchange(l, w) =
for the forward halo and again for the backward halo (same values, reverse direction):
latency + max(bytes w receives, bytes w sends) / bandwidth, when w has any traffic. Sends to
different peers proceed concurrently (full-duplex links, one NIC per worker). `step_times`
gives each layer's slowest worker (the figures a plan reports per layer; `layer_times` alone)
and the step: a worker waits for a halo only until its senders have posted it and it has
travelled (a late sender's share of it after that sender, all of it after the first),
computes its slice, and the loss joins all workers once. With balanced workers that is sum
over layers of [ max_w compute + max_w exchange ]; where the slowest worker changes from
layer to layer (three workers that all exchange with each other), or a late worker's halo
arrived while it computed, the step is shorter than that sum, as the runtime's is.

A calibrated machine refines each term with what a machine measured
(`netpart.cost.machine`).

With `overlap` (workers on machines of their own: the runtime then splits the layers whose
split pays, `netpart.cost.overlap`, and a split layer's work grows by `split_cost`), a
worker's forward halo travels while it computes the interior units of the layer (the share
of its units that read no halo, x the kind's forward share of the slice), and its backward
halo while it computes the layer's weight gradients (half the backward share); and both,
when the layers below the halo form a producer chain (netpart.compile.chains), behind the
chain's late units, forward and backward. Only the rest of each exchange is exposed.
"""

from __future__ import annotations

import numpy as np

from netpart.cost.machine import Machine
from netpart.cost.overlap import apply, choose_splits, hiding
from netpart.models.spec import BYTES_PER_VALUE

__all__ = ["layer_times", "split_layers", "step_times"]


def _worker_times(
    flops, traffic, batch, net, kinds, values, interior, chains, keys, convolved=None
):
    """Per layer and worker [L, P]: compute, one direction's exchange time, the work that
    hides the forward and the backward exchange, and the forward share of compute; and ([L]
    the layers split, [L, P] the work a split could hide behind, both ways)."""
    flops = np.asarray(flops, dtype=np.float64)
    work = net.worker_compute_s(flops, batch, kinds, values, keys, convolved=convolved)
    if net.joined_saving_s:  # a layer with no halo runs in one graph with the layer below
        joined = traffic.sum(axis=(1, 2)) == 0
        joined[0] = False
        work = np.where(joined[:, None], np.maximum(work - net.joined_saving_s, 0.0), work)
    recv = traffic.sum(axis=1)  # [L, P]
    send = traffic.sum(axis=2)
    busy = np.maximum(recv, send) * batch * BYTES_PER_VALUE
    peers = ((traffic + traffic.transpose(0, 2, 1)) > 0).sum(axis=2)  # [L, P]
    phase = np.where(busy > 0, net.phase_s(busy, peers), 0.0)  # one direction
    share = net.forward_shares(kinds, len(flops))[:, None]
    if not (net.overlap and interior is not None):
        zero = np.zeros_like(phase)
        none = (np.zeros(len(flops), dtype=bool), zero)
        return work, phase, zero, zero, np.broadcast_to(share, work.shape), none
    hide_fwd, hide_bwd = hiding(flops, work, share, recv, kinds, interior, chains)
    split = choose_splits(phase, hide_fwd, hide_bwd, net.split_cost)
    choice = (split, hide_fwd + hide_bwd)
    work, share, hide_fwd, hide_bwd = apply(split, work, share, hide_fwd, hide_bwd, net.split_cost)
    return work, phase, hide_fwd, hide_bwd, share, choice


def step_times(
    flops: np.ndarray,
    traffic: np.ndarray,
    batch: int,
    net: Machine,
    kinds: list[str] | None = None,
    values: np.ndarray | None = None,
    interior: np.ndarray | None = None,
    chains: tuple[np.ndarray, np.ndarray] | None = None,
    keys: list[str] | None = None,
    *,
    convolved: np.ndarray | None = None,
    collectives: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """(compute_s[l], exchange_s[l], path_s): the slowest worker's time in each layer
    (exchange: what overlap leaves exposed) and the step's layers on each worker's own
    timeline: a worker waits for a halo only until its senders have posted it and it has
    travelled, so path_s <= the sum of every layer's slowest worker, equal when balanced.

    `flops` is [L, P] per example, `traffic` [L, P, P] units per example (sender, receiver),
    `kinds` each layer's kind, `values` [L, P] the input values each worker's slice gathers
    per example (for a calibrated model) and `interior` [L, P] the share of each worker's
    units of each layer that read no halo (for overlap; none hidden without it), `chains`
    the producer chains' (late share, layer whose exchange it hides) [L, P] each
    (`netpart.partition.planner.chain_shares`), `keys` each layer's `ModelSpec.layer_key`
    (a calibrated model's own tables of those layers), `convolved` [L, P] the share of
    each worker's conv outputs torch's convolution computes (`Machine.worker_compute_s`),
    and `collectives` [L] the seconds of a collective every worker takes part in after the
    layer's compute, forward and again backward (a batch norm's statistics: each worker
    waits for the slowest, then for the collective).
    """
    work, phase, hide_fwd, hide_bwd, share, _ = _worker_times(
        flops, traffic, batch, net, kinds, values, interior, chains, keys, convolved
    )
    exp_f, exp_b = np.maximum(phase - hide_fwd, 0.0), np.maximum(phase - hide_bwd, 0.0)
    fwd, bwd = work * share, work * (1.0 - share)
    joint = np.zeros(len(work)) if collectives is None else np.asarray(collectives, float)
    t = np.zeros(work.shape[1])
    for layer in range(len(work)):  # forward: the halo of the layer, then its compute
        t = _arrive(t, traffic[layer], exp_f[layer]) + fwd[layer]
        if joint[layer]:
            t = np.full_like(t, t.max() + joint[layer])
    t = np.full_like(t, t.max())  # the loss: one collective among all
    for layer in range(len(work) - 1, -1, -1):  # backward: compute, then gradients back
        t = t + bwd[layer]
        if joint[layer]:
            t = np.full_like(t, t.max() + joint[layer])
        t = _arrive(t, traffic[layer].T, exp_b[layer])
    exchange = (exp_f + exp_b).max(axis=1) + 2 * joint
    return work.max(axis=1), exchange, float(t.max())


def split_layers(*args, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """([L] bool, [L] s): the layers the runtime splits to hide their halo, and the work a
    split of each could run beside its halo, both ways, on its busiest worker
    (`netpart.cost.overlap`; none without overlap); the arguments of `step_times`."""
    split, hideable = _worker_times(*args, **kwargs)[-1]
    return split, hideable.max(axis=1)


def layer_times(*args, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(compute_s[l], exchange_s[l]) of `step_times` (same arguments)."""
    compute, exchange, _ = step_times(*args, **kwargs)
    return compute, exchange


def _arrive(t, traffic, exposed):
    """[P]: when each worker has its messages of a phase (`traffic` [sender, receiver]),
    given when each worker posts (`t`) and what the phase leaves exposed when all post at
    once: a sender's share of it after that sender posted, and all of it after the first
    one did; never before the worker arrived itself."""
    into = traffic.sum(axis=0)  # [receiver]
    if not into.any():
        return t + exposed  # sends only: they complete
    sent = traffic > 0
    share = traffic / np.maximum(into, 1e-300)[None, :]
    last = np.where(sent, t[:, None] + share * exposed[None, :], -np.inf).max(axis=0)
    first = np.where(sent, t[:, None], np.inf).min(axis=0) + exposed
    got = np.where(into > 0, np.maximum(last, first), t + exposed)
    return np.maximum(t, got)
