"""Dropout whose masks do not depend on the plan.

A value's mask is a hash of what names it in the network, not of where it is computed: the
run's seed, the step, the layer, the unit (its index in the layer's (C, H, W) order) and the
sample (its index in the step's whole batch, every replica's samples counted). So a worker
that owns units 40-79 of a layer draws exactly the masks the single-process reference draws
for those units, whatever the plan, and the central invariant (a split step equals the
reference step) holds with dropout on; a sync step over R replicas equals the reference step
on their concatenated batch. The hash is a 32-bit xorshift-multiply hash on int64 tensors
(vectorised: one hash per unit, one per sample, one per value).

torch's own `nn.Dropout` draws from its generator, which no split can reproduce: a user's
module is compared with netpart's split step by applying these masks in its dropout modules'
place (`netpart.runtime.check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from netpart.models.spec import ModelSpec

__all__ = ["DropoutKey", "keep_scale", "training_key"]

_M32 = 0xFFFFFFFF
_SAMPLE_SALT = 0x9E3779B9  # samples and units hash apart


@dataclass(frozen=True)
class DropoutKey:
    """What a training step's masks are drawn from: the run's seed, the step's number, and
    the index of this batch's first sample in the step's whole batch (replica r of R with
    batches of B: r * B)."""

    seed: int
    step: int
    first_sample: int = 0


def keep_scale(
    p: float,
    layer: int,
    units: torch.Tensor,
    batch: int,
    key: DropoutKey,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[len(units), batch] of layer `layer`'s outputs `units` (int64 indices) for the key's
    samples: 0 where a value is dropped (probability `p`), 1 / (1 - p) where it is kept."""
    seed = _mix_one((key.seed ^ 0x5BD1E995) & _M32)
    base = _mix_one(_mix_one(seed ^ (key.step & _M32)) ^ layer)
    per_unit = _mix(base ^ (units.to(torch.int64) & _M32))
    samples = torch.arange(key.first_sample, key.first_sample + batch, dtype=torch.int64)
    per_sample = _mix(_mix(samples & _M32) ^ _SAMPLE_SALT)
    value = _mix((per_unit[:, None] + per_sample[None, :]).bitwise_and_(_M32), fresh=True)
    keep = value >= int(p * (1 << 32))
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def _mix(x: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
    """A 32-bit xorshift-multiply hash of 32-bit values held in int64 (the form of Wellons'
    lowbias32, with odd multipliers below 2^31, so that no product overflows); `fresh`: `x`
    is the caller's to overwrite (the hash runs in place)."""
    x = x.bitwise_xor_(x >> 16) if fresh else x ^ (x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def _mix_one(x: int) -> int:
    """`_mix` of one value (a Python int: the key's hashes cost no tensor)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def training_key(spec: ModelSpec, seed: int, step: int, first_sample: int = 0) -> DropoutKey | None:
    """The key of training step `step` of a model of `spec` (its layers' dropout on), or None
    where no layer has dropout."""
    if not spec.dropout_layers:
        return None
    return DropoutKey(seed=seed, step=step, first_sample=first_sample)
