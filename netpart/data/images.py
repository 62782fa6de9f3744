"""Image sources: procedural shapes of any resolution, and folders of images (Pillow).

`shapes`: ten classes (disk, square, triangle, ring, cross, horizontal stripes, vertical
stripes, checkerboard, dots, diamond) drawn at a random place, size, tilt (within 22.5
degrees, so stripes keep their direction), contrast and per-channel colour, plus pixel noise.
Example i is a pure function of (seed, i): any worker renders any batch, at the model's input
resolution, without files. Rendering is vectorised over the examples of a class.

A folder holds one subfolder per class (sorted names are the labels 0, 1, ...), images inside
(png, jpg, jpeg, bmp, gif, tif, tiff, webp; other files are skipped). Images are converted to
the model's channels (L or RGB), resized bilinearly to its input, scaled to [0, 1] and
standardised. An unreadable image is an error naming the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from netpart.errors import DataError

__all__ = ["SHAPE_CLASSES", "load_image_folder", "render_shapes"]

log = logging.getLogger(__name__)

SHAPE_CLASSES = (
    "disk",
    "square",
    "triangle",
    "ring",
    "cross",
    "hstripes",
    "vstripes",
    "checker",
    "dots",
    "diamond",
)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
NOISE = 0.25


def render_shapes(
    ids: np.ndarray, labels: np.ndarray, seed: int, channels: int, height: int, width: int
) -> np.ndarray:
    """Images [len(ids), channels, height, width] (float32) of examples `ids` with `labels`."""
    b = len(ids)
    params = np.empty((b, 6), dtype=np.float64)  # cx, cy, size, angle, contrast, frequency
    gains = np.empty((b, channels), dtype=np.float32)
    noise = np.empty((b, channels, height, width), dtype=np.float32)
    for j, i in enumerate(ids.tolist()):  # one stream per example: a batch is a pure function
        gen = np.random.default_rng([seed, 4, i])
        params[j] = [
            gen.uniform(0.35, 0.65),
            gen.uniform(0.35, 0.65),
            gen.uniform(0.18, 0.3),
            gen.uniform(-np.pi / 8, np.pi / 8),
            gen.uniform(0.6, 1.0),
            gen.uniform(2.0, 3.5),
        ]
        gains[j] = gen.uniform(0.5, 1.0, channels)
        noise[j] = gen.standard_normal((channels, height, width), dtype=np.float32)
    ys = (np.arange(height) + 0.5) / height
    xs = (np.arange(width) + 0.5) / width
    mask = np.zeros((b, height, width), dtype=np.float32)
    for c in np.unique(labels):
        sel = np.flatnonzero(labels == c)
        cx, cy, s, th, _, f = (params[sel, k][:, None, None] for k in range(6))
        dx, dy = xs[None, None, :] - cx, ys[None, :, None] - cy
        u = np.cos(th) * dx + np.sin(th) * dy
        v = -np.sin(th) * dx + np.cos(th) * dy
        mask[sel] = _shape(SHAPE_CLASSES[int(c)], u / s, v / s, f)
    img = (mask * params[:, 4, None, None].astype(np.float32))[:, None] * gains[:, :, None, None]
    return img - 0.15 + NOISE * noise


def _shape(name: str, u: np.ndarray, v: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The mask of one class in shape-relative coordinates (the shape spans about [-1, 1])."""
    r = np.hypot(u, v)
    box = (np.abs(u) < 1) & (np.abs(v) < 1)
    wave = 2 * np.pi * f / 2
    masks = {
        "disk": lambda: r < 1,
        "square": lambda: (np.abs(u) < 0.85) & (np.abs(v) < 0.85),
        "triangle": lambda: (v > -0.6) & (np.abs(u) < (1 - v) * 0.6),
        "ring": lambda: np.abs(r - 0.8) < 0.2,
        "cross": lambda: ((np.abs(u) < 0.3) | (np.abs(v) < 0.3)) & box,
        "hstripes": lambda: box & (np.sin(wave * v) > 0),
        "vstripes": lambda: box & (np.sin(wave * u) > 0),
        "checker": lambda: box & (np.sin(wave * u) * np.sin(wave * v) > 0),
        "dots": lambda: box & (np.sin(wave * u) * np.sin(wave * v) > 0.5),
        "diamond": lambda: np.abs(u) + np.abs(v) < 1.1,
    }
    return masks[name]().astype(np.float32)


def load_image_folder(
    root: Path, channels: int, height: int, width: int, classes: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x [n, channels * height * width] standardised, y [n], class names, (mean, std) it
    was standardised by: of the pixels in [0, 1]) of a folder.

    Raises an error naming the folder or file for a missing or empty folder, a class folder
    without images, one class, more classes than the model has outputs, or unreadable
    images (every one named, up to three); fewer classes than outputs is a warning.
    """
    if not root.is_dir():
        raise DataError(f"--data {root}: no such directory")
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise DataError(
            f"{root}: no class subfolders; expected {root}/<class>/<image> (one folder per class)"
        )
    if len(names) > classes:
        raise DataError(f"{root}: {len(names)} class folders, but the model has {classes} outputs")
    listed = [_class_files(root / name) for name in names]
    if len(names) < 2:
        raise DataError(
            f"{root}: one class folder ({names[0]}); a classifier needs at least two classes"
        )
    if len(names) < classes:
        log.warning(
            "%s: %d classes for a model of %d outputs: outputs %s are never a label",
            root,
            len(names),
            classes,
            _span(len(names), classes - 1),
        )
    xs, ys = _read_images(root, listed, channels, height, width)
    x = np.stack(xs).reshape(len(xs), -1)
    mean, std = float(x.mean()), float(x.std()) + 1e-8
    x = (x - mean) / std
    log.info("%s: %d images in %d classes", root, len(xs), len(names))
    return x.astype(np.float32), np.asarray(ys, dtype=np.int64), names, (mean, std)


def _class_files(folder: Path) -> list[Path]:
    """A class folder's image files, sorted; DataError if it holds none."""
    files = sorted(
        p
        for p in folder.iterdir()
        if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
    )
    if not files:
        kinds = ", ".join(sorted(IMAGE_SUFFIXES))
        raise DataError(f"{folder}: class folder holds no images ({kinds})")
    return files


def _read_images(
    root: Path, listed: list[list[Path]], channels: int, height: int, width: int
) -> tuple[list[np.ndarray], list[int]]:
    """Every image of every class, resized, as [channels, height, width] in [0, 1], and its
    label; DataError naming every file that cannot be read (a non-regular file is not
    opened: a FIFO would block)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - Pillow comes with matplotlib
        raise DataError(f"--data {root}: reading image folders needs Pillow") from None
    mode = "RGB" if channels == 3 else "L"
    xs, ys, bad = [], [], []
    for label, files in enumerate(listed):
        for path in files:
            rel = path.relative_to(root)
            if not path.is_file():
                bad.append(f"{rel}: not a regular file")
                continue
            try:
                with Image.open(path) as im:
                    im = im.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
                    a = np.asarray(im, dtype=np.float32) / 255.0
            except Image.DecompressionBombError:
                most = f"{Image.MAX_IMAGE_PIXELS:,}"
                bad.append(f"{rel}: cannot read image (more pixels than {most})")
                continue
            except (OSError, UnidentifiedImageError, ValueError) as exc:
                bad.append(f"{rel}: cannot read image ({_short(exc)})")
                continue
            a = a.transpose(2, 0, 1) if a.ndim == 3 else a[None]
            xs.append(np.repeat(a, channels, axis=0) if a.shape[0] != channels else a)
            ys.append(label)
    if len(bad) == 1:
        raise DataError(f"{root / bad[0]}; remove or replace it")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DataError(
            f"{root}: {len(bad)} images cannot be read: {'; '.join(bad[:3])}{more}; remove or "
            "replace them"
        )
    return xs, ys


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _short(exc: BaseException) -> str:
    """An exception's first line, short enough to sit in a one-line error."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]
