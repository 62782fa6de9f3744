"""File effects at the edge: atomic writes, and plan files (`plan.json` + `node_map.npy`).

Every write goes to a temporary file in the destination directory and is renamed into place,
so a reader never sees a half-written file and a failed run leaves the old file intact.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np

from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan

__all__ = ["foreign_entries", "load_plan", "plan_files", "write_atomic", "write_files"]


def foreign_entries(out_dir: Path, marker: str, forbidden: tuple[str, ...] = ()) -> list[str]:
    """What makes `out_dir` unsafe to write a command's files into: nothing if it is missing,
    empty, or holds `marker` (that command's own output) and none of `forbidden` (another
    command's); else the names found there (at most five), for the refusal."""
    if not out_dir.is_dir():
        return []
    names = sorted(p.name for p in out_dir.iterdir())
    if not names or (marker in names and not set(forbidden) & set(names)):
        return []
    return names[:5]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # name the file: a full disk's error carries no path
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_files(out_dir: Path, files: dict[str, bytes]) -> None:
    """Write every file atomically; all content is prepared before the first write."""
    for name, data in files.items():
        write_atomic(out_dir / name, data)


def plan_files(plan: PartitionPlan) -> dict[str, bytes]:
    """The bytes of `plan.json` and `node_map.npy` (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, plan.node_map.astype(np.int64), allow_pickle=False)
    return {"plan.json": plan.to_json().encode(), "node_map.npy": buf.getvalue()}


def load_plan(path: str | Path, spec: ModelSpec | None = None) -> PartitionPlan:
    """Read a plan directory (or its plan.json); with `spec`, refuse a plan for another model."""
    p = Path(path)
    plan_json = p / "plan.json" if p.is_dir() else p
    node_path = plan_json.with_name("node_map.npy")
    if not plan_json.exists():
        raise PlanError(f"{plan_json}: no such plan file; create one with `netpart plan --out DIR`")
    if not node_path.exists():
        raise PlanError(f"{node_path}: missing (it is written next to plan.json)")
    try:
        node_map = np.load(node_path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise PlanError(f"{node_path}: not a readable .npy array ({exc})") from None
    try:
        text = plan_json.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{plan_json}: cannot read ({exc})") from None
    plan = PartitionPlan.from_json(text, node_map, str(plan_json))
    if spec is not None:
        plan.check_model(spec)
    return plan
