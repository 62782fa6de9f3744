"""Shard checkpoints and the exported model.

`shard_<s>.pt` holds {"values", "state" (Adagrad sums, when used), "meta" (a JSON string)},
written to a temporary file and renamed, so a crash never leaves a torn checkpoint; a
`shard_<s>.json` sidecar repeats the meta for cheap reading (the .pt's meta is authoritative).
Loading uses `torch.load(weights_only=True)`. `export_state_dict` reassembles the reference
module's `state_dict` from the shards through the layout's piece indices.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from netpart.files import write_atomic
from netpart.models.reference import ReferenceModel
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.partition.shards import ShardLayout, piece_index
from netpart.runtime.config import TrainConfig, TrainError, layout_key
from netpart.runtime.ps import ShardState

__all__ = [
    "checkpoint_meta",
    "export_state_dict",
    "load_shard",
    "model_from_shards",
    "read_progress",
    "read_run",
    "save_model",
    "save_shard",
    "shard_path",
]


def checkpoint_meta(spec: ModelSpec, plan: PartitionPlan, config: TrainConfig) -> dict:
    """What a shard checkpoint must agree with to be resumed by this job."""
    return {
        "schema_version": 1,
        "fingerprint": spec.fingerprint(),
        "layout": layout_key(plan, config.shards),
        "optimizer": config.optimizer,
        "dtype": config.dtype,
    }


def read_run(run: Path) -> tuple[dict[str, Any], ModelSpec, TrainConfig]:
    """(train.json, spec, config) of a run directory; TrainError if it is not one."""
    if not (run / "train.json").exists():
        raise TrainError(f"{run}: no train.json there; is it a netpart run directory?")
    try:
        manifest = json.loads((run / "train.json").read_text())
        spec = ModelSpec.from_json((run / "spec.json").read_text(), str(run / "spec.json"))
    except (OSError, ValueError) as exc:
        raise TrainError(f"{run}: unreadable run files ({exc})") from None
    return manifest, spec, TrainConfig.from_dict(manifest.get("config"), str(run / "train.json"))


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


def load_shard(run: Path, shard: int, expect: dict[str, Any], size: int) -> ShardState:
    """Read and check one shard checkpoint; TrainError names what does not fit."""
    path = shard_path(run, shard)
    if not path.exists():
        raise TrainError(f"{path}: missing; this run has no checkpoint for shard {shard}")
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


def read_progress(run: Path, shards: int, replicas: int, sync: bool = False) -> dict[int, int]:
    """Per replica, the step a resumed replica restarts after: the last step every shard has
    from it (downpour), or the last step every shard applied (sync: replicas move together,
    and one added on resume joins them there)."""
    out = {r: 0 for r in range(replicas)}
    for s in range(shards):
        try:
            meta = json.loads((run / f"shard_{s}.json").read_text())
        except (OSError, ValueError):
            return {r: 0 for r in range(replicas)}
        prog = {int(r): int(v) for r, v in meta.get("progress", {}).items()}
        for r in out:
            mine = int(meta.get("clock", 0)) if sync else prog.get(r, 0)
            out[r] = mine if s == 0 else min(out[r], mine)
    return out


def export_state_dict(
    spec: ModelSpec, layout: ShardLayout, shard_values: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The reference module's parameters from the shards' flat values."""
    flat = torch.cat(shard_values)
    with torch.device("meta"):  # shapes only, no memory
        shapes = {k: v.shape for k, v in ReferenceModel(spec).state_dict().items()}
    out = {k: torch.empty(int(np.prod(s)), dtype=flat.dtype) for k, s in shapes.items()}
    for w in range(layout.workers):
        for piece, off in zip(layout.pieces[w], layout.offsets[w], strict=True):
            idx = torch.from_numpy(piece_index(spec, piece))
            out[piece.name][idx] = flat[int(off) : int(off) + piece.size]
    return {k: v.reshape(shapes[k]) for k, v in out.items()}


def model_from_shards(
    spec: ModelSpec, plan: PartitionPlan, config: TrainConfig, run: Path, layout: ShardLayout
) -> dict[str, torch.Tensor]:
    """The reference `state_dict` of a run, from its shard checkpoints (each one checked)."""
    meta = checkpoint_meta(spec, plan, config)
    values = [load_shard(run, s, meta, int(n)).values for s, n in enumerate(layout.shard_sizes())]
    return export_state_dict(spec, layout, values)


def save_model(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write a `state_dict` atomically (it loads with `torch.load(weights_only=True)`)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(path, buf.getvalue())


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split(". ")[0][:160]
