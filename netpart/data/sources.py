"""Training data: every model worker of a replica draws the same batch, replicas disjoint shards.

A dataset has `n` training examples; replica r of R owns examples r, r + R, r + 2R, ... and
walks them in an order reshuffled every epoch from (seed, replica, epoch). Batches are a pure
function of (replica, step), so the N model workers of a replica agree on their batch without
talking, and a resumed run continues where it stopped. Held-out examples are never trained on.

Sources (`--data`):
  synthetic   Gaussian class prototypes: example i is prototype[y_i] + noise, drawn from a
              Philox stream keyed by (seed, i); any spec, no files; 1,000 held out
  shapes      procedural images of ten shape/texture classes at the model's resolution
              (netpart.data.images); pure in (seed, i); 1,000 held out
  digits      scikit-learn's bundled 1,797 handwritten 8x8 digits (offline), resized to the
              model's input and standardised
  FILE.npz    arrays `x` and `y` [n] (and optionally `x_test`, `y_test`); for an image model
              x is [n, C, H, W] (channels first, as PyTorch), [n, H, W] for one channel, or
              [n, C*H*W] read in that order; channels-last [n, H, W, C] is refused unless
              the layout says so (`--layout nhwc`: transposed to channels first)
  DIR         one subfolder of images per class (Pillow)
Where no test arrays are given, a fixed 20% (a permutation seeded 12345, not --seed) is held out.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from netpart.data.images import SHAPE_CLASSES, load_image_folder, render_shapes
from netpart.errors import DataError
from netpart.models.spec import ModelSpec

__all__ = ["DataError", "Dataset", "load_data"]

PROTOTYPE_CACHE = 256  # prototypes kept per process (each is one input's worth of floats)
GENERATED_HELD_OUT = 1000  # held-out examples of the generated sources (ids n .. n + 999)
HELD_OUT = 0.2  # fraction of digits, npz and folders held out, by a fixed permutation
EPOCH_COPY_BYTES = 1 << 26  # in-memory inputs up to this size are gathered once per epoch


@dataclass(frozen=True, eq=False)
class Dataset:
    """`n` examples served in replica-disjoint, epoch-shuffled batches."""

    spec: ModelSpec
    n: int
    seed: int
    source: str
    x: np.ndarray | None = None  # in-memory arrays (npz, digits, folders)
    y: np.ndarray | None = None
    held_out: tuple[np.ndarray, np.ndarray] | None = None  # (x, y) never trained on
    noise: float = 1.0
    render: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None  # ids -> x, y
    # Image folders: (mean, std) the pixels in [0, 1] were standardised by
    standardised: tuple[float, float] | None = None
    classes: tuple[str, ...] | None = None  # each label's name (image folders: folder order)
    _cache: dict = field(default_factory=dict, repr=False)  # class -> prototype

    def preprocessing(self) -> dict:
        """What a user's own model must be fed, and what its outputs mean: the source, the
        input it takes, the standardisation applied (None: inputs as the source gives them)
        and each output's class name (None: the labels are the output indices)."""
        mean_std = None
        if self.standardised is not None:
            mean_std = {"mean": self.standardised[0], "std": self.standardised[1]}
        take = "pixels in [0, 1], then (x - mean) / std" if mean_std else "inputs as trained"
        return {
            "source": self.source,
            "input": take,
            "standardised": mean_std,
            "classes": list(self.classes) if self.classes is not None else None,
        }

    def held_out_set(self) -> tuple[np.ndarray, np.ndarray]:
        """(x [m, features], y) of the held-out examples (generated sources: ids n .. n+999)."""
        if self.held_out is not None:
            return self.held_out
        ids = np.arange(self.n, self.n + GENERATED_HELD_OUT)
        if self.render is not None:
            return self.render(ids)
        x, y = self._synthetic(ids, torch.float32)
        return x.numpy(), y.numpy()

    def indices(self, replica: int, replicas: int, step: int, batch: int) -> np.ndarray:
        """Example ids of replica `replica`'s batch at `step` (1-based): the replica owns ids
        replica, replica + replicas, ... and walks a fresh shuffle of them every epoch."""
        count, epoch, within = self._place(replica, replicas, step, batch)
        if within + batch <= count:  # the batch lies in one epoch (the usual case)
            k = self._order(replica, count, epoch)[within : within + batch]
        else:
            pos = (step - 1) * batch + np.arange(batch)
            epochs, at = np.divmod(pos, count)
            k = np.empty(batch, dtype=np.int64)
            # A batch can span several epochs of few examples (not np.unique: its first call
            # imports numpy.ma, a stall in the middle of a run).
            for e in range(int(epochs[0]), int(epochs[-1]) + 1):
                sel = epochs == e
                k[sel] = self._order(replica, count, int(e))[at[sel]]
        return replica + replicas * k

    def _place(self, replica: int, replicas: int, step: int, batch: int) -> tuple[int, int, int]:
        """(examples the replica owns, the epoch its batch at `step` starts in, where in it)."""
        count = len(range(replica, self.n, replicas))
        if count == 0:
            raise DataError(f"{self.source}: {self.n} examples cannot feed {replicas} replicas")
        return count, *divmod((step - 1) * batch, count)

    def _order(self, replica: int, count: int, epoch: int) -> np.ndarray:
        """Replica `replica`'s shuffle of its `count` examples in `epoch` (cached; older
        epochs than the one before are dropped, with what `_epoch` keeps of them)."""
        key = ("order", replica, count, epoch)
        order = self._cache.get(key)
        if order is None:
            stale = [
                k
                for k in self._cache
                if isinstance(k, tuple) and k[1] == replica and k[3] < epoch - 1
            ]
            for old in stale:
                del self._cache[old]
            gen = np.random.default_rng([self.seed, replica, epoch])
            order = self._cache[key] = gen.permutation(count)
        return order

    def batch(
        self, replica: int, replicas: int, step: int, batch: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, features], targets) of one step of one replica: the examples
        `indices` names. In-memory arrays up to EPOCH_COPY_BYTES are gathered once per epoch
        in the replica's order, and a batch inside one epoch is copied from a slice of them
        (a gather of random rows in a busy step loop costs several times a copy)."""
        count, epoch, within = self._place(replica, replicas, step, batch)
        in_memory = self.x is not None and self.y is not None
        if in_memory and self.x.nbytes <= EPOCH_COPY_BYTES and within + batch <= count:
            x, y = self._epoch(replica, replicas, count, epoch, dtype)
            return x[within : within + batch].clone(), y[within : within + batch].clone()
        return self.examples(self.indices(replica, replicas, step, batch), dtype)

    def _epoch(self, replica: int, replicas: int, count: int, epoch: int, dtype: torch.dtype):
        """Replica `replica`'s examples in their order of `epoch` (cached with that order:
        older epochs than the one before are dropped)."""
        key = ("examples", replica, count, epoch, dtype)
        got = self._cache.get(key)
        if got is None:
            ids = replica + replicas * self._order(replica, count, epoch)
            got = self._cache[key] = self.examples(ids, dtype)
        return got

    def examples(self, ids: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [len(ids), features], targets) of the training examples `ids`."""
        batch = len(ids)
        if self.x is not None and self.y is not None:
            x = torch.from_numpy(self.x[ids].reshape(batch, -1)).to(dtype)
            y = torch.from_numpy(self.y[ids])
            return x, (y.long() if self.spec.loss == "cross_entropy" else y.to(dtype))
        if self.render is not None:
            x, y = self.render(ids)
            return torch.from_numpy(x).to(dtype), torch.from_numpy(y)
        return self._synthetic(ids, dtype)

    def _prototype(self, c: int) -> np.ndarray:
        """Class c's prototype, drawn once per process (at most `PROTOTYPE_CACHE` kept)."""
        cache = self._cache
        if c not in cache:
            kept = [k for k in cache if not isinstance(k, tuple)]
            if len(kept) >= PROTOTYPE_CACHE:
                cache.pop(kept[0])
            d = self.spec.input.shape.size
            cache[c] = np.random.default_rng([self.seed, 1, c]).standard_normal(d, dtype=np.float32)
        return cache[c]

    def _synthetic(self, ids: np.ndarray, dtype: torch.dtype):
        spec = self.spec
        d, out = spec.input.shape.size, spec.shapes[-1].size
        classes = spec.shapes[-1].channels if spec.loss == "cross_entropy" else 10
        labels = _labels(self.seed, classes, self.n + GENERATED_HELD_OUT)[ids]
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


LAYOUTS = ("nchw", "nhwc")


def load_data(
    source: str, spec: ModelSpec, seed: int = 0, examples: int = 60000, layout: str = "nchw"
) -> Dataset:
    """The dataset `source` names (see the module docstring), checked against the spec;
    `layout`: how an image model's .npz arrays are laid out (nchw, or nhwc to transpose).

    Raises DataError (one line naming the file) for data that cannot be read or does not fit.
    """
    if source == "synthetic":
        return Dataset(spec, examples, seed, source)
    if source == "shapes":
        return _shapes(spec, seed, examples)
    if source == "digits":
        return _digits(spec, seed)
    path = Path(source)
    if path.is_dir():
        return _folder(spec, seed, path)
    if not path.exists() and (path.suffix == ".npz" or source.endswith("/")):
        raise DataError(f"--data {source}: no such file or directory")
    if path.suffix != ".npz":
        raise DataError(
            f"--data {source}: expected synthetic, shapes, digits, a .npz file with x and y, "
            "or a folder of class subfolders"
        )
    _check_npz_sizes(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in ("x", "y", "x_test", "y_test") if k in f.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as .npz ({exc})") from None
    except MemoryError:  # a header that claims more than this machine holds
        raise DataError(f"{path}: its arrays are larger than this machine's memory") from None
    missing = sorted({"x", "y"} - set(arrays))
    if missing:
        raise DataError(f"{path}: no array {missing[0]!r}; save x [n, ...] and y [n]")
    x, y = _checked(
        path, "x", "y", _laid_out(path, "x", arrays["x"], spec, layout), arrays["y"], spec
    )
    if "x_test" in arrays and "y_test" in arrays:
        x_test = _laid_out(path, "x_test", arrays["x_test"], spec, layout)
        test = _checked(path, "x_test", "y_test", x_test, arrays["y_test"], spec)
        return Dataset(spec, len(x), seed, str(path), x=x, y=y, held_out=test)
    return _split(spec, seed, str(path), x, y)


def _check_npz_sizes(path: Path) -> None:
    """DataError, before anything is decompressed, for an .npz whose arrays' headers declare
    more bytes than this machine has available (a deflate bomb declares what it inflates to)."""
    import zipfile

    from netpart.processes.memory import available_memory

    try:
        with zipfile.ZipFile(path) as zf:
            declared = 0
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(member)
                declared += int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    except (OSError, ValueError, zipfile.BadZipFile):
        return  # np.load says what is wrong with it
    if declared > available_memory():
        raise DataError(
            f"{path}: its arrays declare {declared / 2**30:,.1f} GiB, more than this machine's "
            f"{available_memory() / 2**30:.1f} GiB available"
        )


def _laid_out(path: Path, name: str, x: np.ndarray, spec: ModelSpec, layout: str) -> np.ndarray:
    """An image model's x as channels first: refused if it is channels-last and the layout
    does not say so, transposed if it says nhwc (the rule in the module docstring)."""
    if layout not in LAYOUTS:
        raise DataError(f"--layout {layout}: choose nchw or nhwc")
    i = spec.input
    one_channel = x.ndim == 3 and i.channels == 1 and x.shape[1:] == (i.height, i.width)
    if i.flat or x.ndim <= 2 or one_channel:
        if layout == "nhwc" and not i.flat:
            raise DataError(f"{path}: --layout nhwc needs {name} [n, H, W, C]; it is {x.shape}")
        return x
    chw, hwc = (i.channels, i.height, i.width), (i.height, i.width, i.channels)
    if layout == "nhwc":
        if x.shape[1:] != hwc:
            raise DataError(
                f"{path}: --layout nhwc needs {name} [n, {i.height}, {i.width}, "
                f"{i.channels}]; it is {x.shape}"
            )
        return x.transpose(0, 3, 1, 2)
    if x.shape[1:] == hwc and hwc != chw:
        raise DataError(
            f"{path}: {name} is {x.shape}, channels last; {spec.name} reads [n, {i.channels}, "
            f"{i.height}, {i.width}] (channels first): save x.transpose(0, 3, 1, 2), or pass "
            "--layout nhwc"
        )
    if x.shape[1:] != chw:
        raise DataError(
            f"{path}: {name} is {x.shape}; {spec.name} reads [n, {i.channels}, {i.height}, "
            f"{i.width}] (or [n, {i.channels * i.height * i.width}] in that order)"
        )
    return x


def _checked(path, xname, yname, x, y, spec) -> tuple[np.ndarray, np.ndarray]:
    """x reshaped to [n, features] and y, or DataError naming the file and the array."""
    d = spec.input.shape.size
    if x.ndim < 1 or len(x) == 0:
        raise DataError(f"{path}: {xname} holds no examples")
    if x.ndim < 2 or int(np.prod(x.shape[1:])) != d or y.ndim != 1 or len(y) != len(x):
        raise DataError(
            f"{path}: {xname} is {x.shape} and {yname} {y.shape}; {spec.name} needs {xname} "
            f"[n, {d}] (any shape with {d} values per example) and {yname} [n]"
        )
    if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
        raise DataError(f"{path}: {xname} must hold finite numbers")
    if spec.loss == "cross_entropy":
        classes = spec.shapes[-1].channels
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes:
            found = f"{y.min()}..{y.max()}" if np.issubdtype(y.dtype, np.number) else str(y.dtype)
            raise DataError(
                f"{path}: {yname} must be integer classes in [0, {classes}) for {spec.name}; "
                f"found {y.dtype} values {found}"
            )
    return np.ascontiguousarray(x.reshape(len(x), d), dtype=np.float32), y


def _split(spec: ModelSpec, seed: int, source: str, x: np.ndarray, y: np.ndarray) -> Dataset:
    """Hold out a fixed HELD_OUT share (at least one example) of in-memory data."""
    if len(x) < 2:
        raise DataError(f"{source}: {len(x)} example(s); need at least 2 (one is held out)")
    order = np.random.default_rng(12345).permutation(len(x))
    cut = min(len(x) - 1, round(len(x) * (1 - HELD_OUT)))
    train, test = order[:cut], order[cut:]
    return Dataset(spec, cut, seed, source, x=x[train], y=y[train], held_out=(x[test], y[test]))


def _labels(seed: int, classes: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).integers(0, classes, n)


def _image_input(spec: ModelSpec, source: str) -> tuple[int, int, int]:
    inp = spec.input
    if inp.flat:
        raise DataError(f"--data {source}: {spec.name} takes a flat input, not images")
    return inp.channels, inp.height, inp.width


def _classes(spec: ModelSpec, source: str, at_least: int) -> int:
    if spec.loss != "cross_entropy" or spec.shapes[-1].channels < at_least:
        raise DataError(
            f"--data {source}: {spec.name} needs a softmax output of at least {at_least} classes"
        )
    return spec.shapes[-1].channels


def _shapes(spec: ModelSpec, seed: int, examples: int) -> Dataset:
    k = len(SHAPE_CLASSES)
    _classes(spec, "shapes", k)
    c, h, w = _image_input(spec, "shapes")
    labels = _labels(seed, k, examples + GENERATED_HELD_OUT)

    def render(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = render_shapes(ids, labels[ids], seed, c, h, w)
        return x.reshape(len(ids), -1), labels[ids]

    return Dataset(spec, examples, seed, "shapes", render=render, classes=tuple(SHAPE_CLASSES))


def _folder(spec: ModelSpec, seed: int, root: Path) -> Dataset:
    c, h, w = _image_input(spec, str(root))
    classes = _classes(spec, str(root), 1)
    x, y, names, standard = load_image_folder(root, c, h, w, classes)
    data = _split(spec, seed, str(root), x, y)
    return dataclasses.replace(data, standardised=standard, classes=tuple(names))


def _digits(spec: ModelSpec, seed: int) -> Dataset:
    _classes(spec, "digits", 10)
    target, flat = _digits_arrays()
    images = torch.from_numpy(flat.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    _classes(spec, "digits", 10)
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
    digits = tuple(str(d) for d in range(10))
    return dataclasses.replace(_split(spec, seed, "digits", x, target), classes=digits)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (labels, 64 pixels 0-16 each), read from its csv file:
    what `sklearn.datasets.load_digits` returns, without importing scikit-learn (1.6 s)."""
    found = importlib.util.find_spec("sklearn")
    path = Path(found.origin).parent / "datasets" / "data" / "digits.csv.gz" if found else None
    if path is None or not path.is_file():
        raise DataError("--data digits needs scikit-learn (pip install scikit-learn)")
    table = np.loadtxt(path, delimiter=",")
    return table[:, -1].astype(np.int64), table[:, :-1]
