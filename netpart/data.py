"""Training data: every model worker of a replica draws the same batch, replicas disjoint shards.

A dataset has `n` examples; replica r of R owns examples r, r + R, r + 2R, ... and walks them
in an order reshuffled every epoch from (seed, replica, epoch). Batches are a pure function of
(replica, step), so the N model workers of a replica agree on their batch without talking,
and a resumed run continues where it stopped.

Sources: `synthetic` (Gaussian class prototypes: example i has class y_i and input
prototype[y_i] + noise, each drawn from a Philox stream keyed by (seed, i); learnable by any
spec, no files), `digits` (scikit-learn's bundled 1797 handwritten 8x8 digits, offline,
resized bilinearly to the model's input and standardised; a fixed 20% is held out) and `.npz`
files with arrays `x` [n, ...] and `y` [n].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from netpart.errors import NetpartError
from netpart.models.spec import ModelSpec

__all__ = ["DataError", "Dataset", "load_data"]

PROTOTYPE_CACHE = 256  # prototypes kept per process (each is one input's worth of floats)


class DataError(NetpartError):
    """A data source that cannot be read or does not fit the model."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """`n` examples served in replica-disjoint, epoch-shuffled batches."""

    spec: ModelSpec
    n: int
    seed: int
    source: str
    x: np.ndarray | None = None  # in-memory arrays (npz, digits); None for synthetic
    y: np.ndarray | None = None
    held_out: tuple[np.ndarray, np.ndarray] | None = None  # (x, y) never trained on
    noise: float = 1.0
    _cache: dict = field(default_factory=dict, repr=False)  # class -> prototype

    def indices(self, replica: int, replicas: int, step: int, batch: int) -> np.ndarray:
        """Example ids of replica `replica`'s batch at `step` (1-based)."""
        own = np.arange(replica, self.n, replicas)
        if len(own) == 0:
            raise DataError(f"{self.source}: {self.n} examples cannot feed {replicas} replicas")
        pos = (step - 1) * batch + np.arange(batch)
        epoch, within = np.divmod(pos, len(own))
        out = np.empty(batch, dtype=np.int64)
        for e in np.unique(epoch):  # at most two epochs per batch
            gen = np.random.default_rng([self.seed, replica, int(e)])
            order = gen.permutation(len(own))
            sel = epoch == e
            out[sel] = own[order[within[sel]]]
        return out

    def batch(
        self, replica: int, replicas: int, step: int, batch: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, features], targets) of one step of one replica."""
        ids = self.indices(replica, replicas, step, batch)
        if self.x is not None and self.y is not None:
            x = torch.from_numpy(self.x[ids].reshape(batch, -1)).to(dtype)
            y = torch.from_numpy(self.y[ids])
            return x, (y.long() if self.spec.loss == "cross_entropy" else y.to(dtype))
        return self._synthetic(ids, dtype)

    def _prototype(self, c: int) -> np.ndarray:
        """Class c's prototype, drawn once per process (at most `PROTOTYPE_CACHE` kept)."""
        cache = self._cache
        if c not in cache:
            if len(cache) >= PROTOTYPE_CACHE:
                cache.pop(next(iter(cache)))
            d = self.spec.input.shape.size
            cache[c] = np.random.default_rng([self.seed, 1, c]).standard_normal(d, dtype=np.float32)
        return cache[c]

    def _synthetic(self, ids: np.ndarray, dtype: torch.dtype):
        spec = self.spec
        d, out = spec.input.shape.size, spec.shapes[-1].size
        classes = spec.shapes[-1].channels if spec.loss == "cross_entropy" else 10
        labels = np.random.default_rng([self.seed, 0]).integers(0, classes, self.n)[ids]
        x = np.stack([self._prototype(c) for c in labels.tolist()])
        for j, i in enumerate(ids.tolist()):  # one stream per example: a batch is a pure function
            gen = np.random.default_rng([self.seed, 2, i])
            x[j] += self.noise * gen.standard_normal(d, dtype=np.float32)
        if spec.loss == "cross_entropy":
            return torch.from_numpy(x).to(dtype), torch.from_numpy(labels)
        targets = np.stack(
            [np.random.default_rng([self.seed, 3, c]).standard_normal(out) for c in labels]
        )
        return torch.from_numpy(x).to(dtype), torch.from_numpy(targets).to(dtype)


def load_data(source: str, spec: ModelSpec, seed: int = 0, examples: int = 60000) -> Dataset:
    """`synthetic`, `digits` or a `.npz` path with `x` and `y`, checked against the spec."""
    if source == "synthetic":
        return Dataset(spec, examples, seed, source)
    if source == "digits":
        return _digits(spec, seed)
    path = Path(source)
    if path.suffix != ".npz":
        raise DataError(
            f"--data {source}: expected 'synthetic', 'digits' or a .npz file with x and y"
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path}: cannot read arrays x and y ({exc})") from None
    d = spec.input.shape.size
    if x.ndim < 2 or int(np.prod(x.shape[1:])) != d or len(y) != len(x):
        raise DataError(
            f"{path}: x is {x.shape} and y {y.shape}; {spec.name} needs x [n, {d}] "
            "(any shape with that many values per example) and one target per example"
        )
    if spec.loss == "cross_entropy":
        classes = spec.shapes[-1].channels
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes:
            raise DataError(f"{path}: y must be integer classes in [0, {classes})")
    return Dataset(spec, len(x), seed, str(path), x=x, y=y)


HELD_OUT = 0.2  # fraction of `digits` held out, chosen by a fixed permutation (not --seed)


def _digits(spec: ModelSpec, seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - a declared dependency
        raise DataError("--data digits needs scikit-learn (pip install scikit-learn)") from None
    if spec.loss != "cross_entropy" or spec.shapes[-1].channels < 10:
        raise DataError(f"--data digits: {spec.name} needs a softmax output of at least 10 classes")
    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # [n, 1, 8, 8]
    inp = spec.input
    if inp.flat:
        if inp.shape.size != 64:
            raise DataError(f"--data digits: {spec.name} takes {inp.shape.size} features, not 64")
        x = images.reshape(len(images), 64)
    else:
        x = torch.nn.functional.interpolate(
            images, size=(inp.height, inp.width), mode="bilinear", align_corners=False
        ).repeat(1, inp.channels, 1, 1)
    x = ((x - x.mean()) / x.std()).reshape(len(x), -1).numpy()
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(12345).permutation(len(x))
    cut = round(len(x) * (1 - HELD_OUT))
    train, test = order[:cut], order[cut:]
    return Dataset(spec, cut, seed, "digits", x=x[train], y=y[train], held_out=(x[test], y[test]))
