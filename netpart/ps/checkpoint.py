"""Shard checkpoints and the exported model (what a run directory's job files mean is
`netpart.train.rundir`'s).

`shard_<s>.pt` holds {"values", "state" (Adagrad sums, when used), "meta" (a JSON string)},
written to a temporary file and renamed, so a crash never leaves a torn checkpoint; a
`shard_<s>.json` sidecar repeats the meta for cheap reading (the .pt's meta is authoritative).
Loading uses `torch.load(weights_only=True)`. `export_state_dict` reassembles the reference
module's `state_dict` from the shards through the layout's piece indices.

`statistics_w<k>.pt` holds the batch norms' running statistics replica 0's worker k keeps
(not the shards': they are not trained by gradients; docs/training.md), written at the
steps the shards checkpoint and at the end, read back by a resumed replica 0 and by the
export (`read_statistics`).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from netpart.compile.shards import ShardLayout, piece_index
from netpart.errors import TrainError
from netpart.files import write_atomic
from netpart.models.reference import ReferenceModel
from netpart.models.spec import ModelSpec
from netpart.ps.server import ShardState

__all__ = [
    "export_state_dict",
    "keep_previous",
    "load_shard",
    "read_statistics",
    "restore_previous",
    "save_model",
    "save_shard",
    "save_statistics",
    "shard_meta",
    "shard_path",
    "statistics_path",
]


def shard_path(run: Path, shard: int) -> Path:
    return run / f"shard_{shard}.pt"


def save_shard(run: Path, shard: int, state: ShardState, meta: dict[str, Any]) -> None:
    """Write shard `shard`'s checkpoint atomically (then its sidecar)."""
    meta = {
        **meta,
        "shard": shard,
        "clock": state.clock,
        "updates": state.updates,
        "progress": {str(r): s for r, s in state.progress.items()},
    }
    payload: dict[str, Any] = {"values": state.values, "meta": json.dumps(meta)}
    if state.state is not None:
        payload["state"] = state.state
    buf = io.BytesIO()
    torch.save(payload, buf)
    write_atomic(shard_path(run, shard), buf.getvalue())
    write_atomic(run / f"shard_{shard}.json", json.dumps(meta, indent=1).encode())


def keep_previous(run: Path, shard: int) -> None:
    """Before a new checkpoint replaces shard `shard`'s: keep the current one (and its
    sidecar) as `shard_<s>.prev.pt` (a hard link: no copy; the current stays in place until
    the new one's rename)."""
    for suffix in (".pt", ".json"):
        current = run / f"shard_{shard}{suffix}"
        if current.exists():
            tmp = run / f".shard_{shard}.prev{suffix}.tmp"
            tmp.unlink(missing_ok=True)
            os.link(current, tmp)
            os.replace(tmp, run / f"shard_{shard}.prev{suffix}")


def restore_previous(run: Path, shard: int) -> bool:
    """Put shard `shard`'s previous checkpoint back in place of the current one (whose state
    may be a diverged one); False if there is none."""
    previous = run / f"shard_{shard}.prev.pt"
    if not previous.exists():
        return False
    for suffix in (".json", ".pt"):  # the .pt last: it is what a resume reads
        kept = run / f"shard_{shard}.prev{suffix}"
        if kept.exists():
            os.replace(kept, run / f"shard_{shard}{suffix}")
    return True


def _missing(run: Path, shard: int) -> TrainError:
    """A shard checkpoint a resume needs and does not find: not a dead end."""
    return TrainError(
        f"{shard_path(run, shard)}: missing: shard {shard} ended before its first checkpoint, "
        f"so {run} cannot be resumed; start it over with the same command and --out {run} "
        "instead of --resume"
    )


def shard_meta(run: Path, shard: int) -> dict[str, Any]:
    """The metadata inside shard `shard`'s checkpoint (its progress, clock, updates, lost
    replicas): the authority on where the shard stands, read without loading its values (a
    memory map). The `.json` sidecar repeats it for people; a missing or stale sidecar (a
    crash between the two renames) changes nothing. TrainError (one line) if unreadable."""
    path = shard_path(run, shard)
    if not path.exists():
        raise _missing(run, shard)
    try:
        meta = json.loads(torch.load(path, weights_only=True, mmap=True)["meta"])
        int(meta["clock"]), int(meta["updates"]), dict(meta["progress"])
    except Exception as exc:  # a torn or foreign file: zip, pickle and key errors alike
        raise TrainError(f"{path}: not a readable netpart checkpoint ({_short(exc)})") from None
    return meta


def load_shard(run: Path, shard: int, expect: dict[str, Any], size: int) -> ShardState:
    """Read and check one shard checkpoint; TrainError names what does not fit."""
    path = shard_path(run, shard)
    if not path.exists():
        raise _missing(run, shard)
    try:  # torch.load does not check the zip's CRC-32s: flipped bytes would load as values
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (OSError, zipfile.BadZipFile) as exc:
        raise TrainError(f"{path}: not a readable netpart checkpoint ({_short(exc)})") from None
    if bad is not None:
        raise TrainError(
            f"{path}: corrupt ({bad} fails its CRC-32 check); restore it from a copy or start "
            "a new --out directory"
        )
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
        meta = json.loads(data["meta"])
        values = data["values"]
    except Exception as exc:  # a torn or foreign file: pickle, zip and key errors alike
        raise TrainError(f"{path}: not a readable netpart checkpoint ({_short(exc)})") from None
    for key, want in expect.items():
        if meta.get(key) != want:
            raise TrainError(
                f"{path}: {key} is {meta.get(key)!r}, this job has {want!r}; resume with the "
                "same model, plan, shard count and optimizer, or start a new --out directory"
            )
    state = data.get("state")
    if not isinstance(values, torch.Tensor) or values.ndim != 1 or values.numel() != size:
        raise TrainError(f"{path}: holds {getattr(values, 'shape', '?')} values, expected {size}")
    if state is not None and state.shape != values.shape:
        raise TrainError(f"{path}: optimizer state does not match the values")
    return ShardState(
        values=values,
        state=state,
        clock=int(meta["clock"]),
        updates=int(meta["updates"]),
        progress={int(r): int(s) for r, s in meta["progress"].items()},
    )


def export_state_dict(
    spec: ModelSpec, layout: ShardLayout, shard_values: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The reference module's parameters from the shards' flat values (its buffers, a batch
    norm's running statistics, as torch's BatchNorm starts them: the shards hold none)."""
    flat = torch.cat(shard_values)
    with torch.device("meta"):  # shapes only, no memory
        shapes = {k: v.shape for k, v in ReferenceModel(spec).state_dict().items()}
    out = {k: torch.empty(int(np.prod(s)), dtype=flat.dtype) for k, s in shapes.items()}
    for k, v in out.items():
        if k.endswith("running_var"):
            v.fill_(1.0)
        elif k.endswith(("running_mean", "num_batches_tracked")):
            v.zero_()
    out.update(
        {k: torch.zeros((), dtype=torch.int64) for k in shapes if k.endswith("batches_tracked")}
    )
    for w in range(layout.workers):
        for piece, off in zip(layout.pieces[w], layout.offsets[w], strict=True):
            idx = torch.from_numpy(piece_index(spec, piece))
            out[piece.name][idx] = flat[int(off) : int(off) + piece.size]
    return {k: v.reshape(shapes[k]) for k, v in out.items()}


def save_model(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write a `state_dict` atomically (it loads with `torch.load(weights_only=True)`)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(path, buf.getvalue())


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split(". ")[0][:160]


def statistics_path(run: Path, worker: int) -> Path:
    return run / f"statistics_w{worker}.pt"


def save_statistics(
    run: Path, worker: int, step: int, entries: list[tuple[str, object, torch.Tensor]], tracked
) -> None:
    """Replica 0's worker `worker`'s running statistics after step `step` (`entries`:
    (reference buffer name, channels, values); `tracked`: each batch norm's count of
    batches, by layer), atomically."""
    buf = io.BytesIO()
    torch.save(
        {
            "step": step,
            "names": [n for n, _, _ in entries],
            "channels": [torch.as_tensor(c, dtype=torch.int64) for _, c, _ in entries],
            "values": [v for _, _, v in entries],
            "tracked": {str(k): int(v) for k, v in tracked.items()},
        },
        buf,
    )
    write_atomic(statistics_path(run, worker), buf.getvalue())


def read_statistics(
    run: Path, spec: ModelSpec, workers: int
) -> tuple[dict[str, torch.Tensor], int | None]:
    """(the batch norms' running statistics and counts of batches replica 0's workers last
    wrote, by reference buffer name; the step they were written at, None if none were).
    TrainError for a file that is not one netpart wrote, or workers at different steps."""
    out: dict[str, torch.Tensor] = {}
    steps = set()
    for w in range(workers):
        path = statistics_path(run, w)
        if not path.exists():
            continue
        try:
            d = torch.load(path, weights_only=True)
            entries = zip(d["names"], d["channels"], d["values"], strict=True)
            steps.add(int(d["step"]))
            for name, channels, values in entries:
                channels_of = spec.shapes[int(name.split(".")[1])].channels
                default = 0.0 if name.endswith("mean") else 1.0
                full = out.setdefault(name, torch.full((channels_of,), default, dtype=values.dtype))
                full[channels] = values.to(full.dtype)
            for layer, count in d["tracked"].items():
                out[f"layers.{layer}.num_batches_tracked"] = torch.tensor(count)
        except Exception as exc:  # a torn or foreign file: torch's message runs to many lines
            raise TrainError(
                f"{path}: not a statistics file netpart wrote ({type(exc).__name__}); "
                "resume from a clean run directory"
            ) from None
    if len(steps) > 1:
        raise TrainError(
            f"{run}: replica 0's workers wrote their running statistics at different steps "
            f"({sorted(steps)}); the run stopped while writing them"
        )
    return out, (steps.pop() if steps else None)
