"""PartitionPlan: which worker owns which block, with its figures; `plan.json` and its files.

`plan.json` schema (version 1), written next to `node_map.npy` (int64 [blocks], block -> worker,
block ids as in `UnitGraph`, i.e. contiguous per layer in (channel group, row, column) order)::

    schema_version      1
    model, fingerprint  the ModelSpec's name and architecture digest; loading checks the digest
    method, seed        partitioner and its seed; options: method options + granularity
                        ({spatial_blocks, dense_blocks, max_blocks, align_pools}: the graph the
                        node map indexes; align_pools absent in older files means false)
    workers, batch      worker count; batch size the step-time prediction assumes
    network             {bandwidth_bps, latency_s, flops_per_s} of the prediction; with a
                        calibrated profile also kinds ({kind: {fixed_s, flops_per_s}}),
                        step_fixed_s, collective_s and profile (its path)
    metrics             edge_cut (units read across workers, summed over cut block edges),
                        volume and lower_bound (activation values sent per example per forward
                        pass; backward sends as many gradients back; the bound is for the number
                        of workers each layer is spread over), max_layer_imbalance
                        (max over layers of max/mean worker FLOPs, mean over the min(P, blocks)
                        workers a layer can be spread over), predicted_step_s, compute_s,
                        exchange_s
    layers              per layer: name, shape, blocks, spread (min(P, blocks)), workers_used,
                        volume, lower_bound, imbalance, compute_s, exchange_s
    per_worker          per worker: flops (forward+backward per example, per layer), params,
                        halo_in_bytes / halo_out_bytes (forward, per example), neighbours
    auto                (only when `--method auto` chose the plan) {rule, candidates: [{method,
                        options, metrics, skipped}]}: every plan weighed; `skipped` (present
                        only then) says why a candidate's exchange was not modelled — a lower
                        bound on its step (its predicted_step_s there) put it out of the tie
                        with the best so far; `method` and `options` above are the winner's, so
                        the plan re-runs with an explicit --method
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netpart.cost.machine import Machine
from netpart.errors import PlanError
from netpart.models.spec import ModelSpec
from netpart.partition.blocks import Granularity

__all__ = [
    "SCHEMA_VERSION",
    "Candidate",
    "LayerFigures",
    "PartitionPlan",
    "PlanMetrics",
    "WorkerFigures",
    "load_plan",
    "plan_files",
]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PlanMetrics:
    edge_cut: int
    volume: int
    lower_bound: int
    max_layer_imbalance: float
    predicted_step_s: float
    compute_s: float
    exchange_s: float

    @property
    def volume_ratio(self) -> float:
        """volume / lower_bound (inf when the bound is 0 but traffic is not)."""
        if self.lower_bound == 0:
            return 1.0 if self.volume == 0 else float("inf")
        return self.volume / self.lower_bound


@dataclass(frozen=True)
class Candidate:
    """A plan `auto` weighed: its method, the options it ran with, and its figures. A
    candidate `skipped` (why, in words) was partitioned but its exchange was not modelled:
    its step could not come within the tie of the best so far. Its volume, bound, balance
    and edge cut are exact; its predicted and compute seconds are a lower bound on its step
    (compute alone) and its exchange seconds 0."""

    method: str
    options: dict[str, Any]
    metrics: PlanMetrics
    skipped: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "options": self.options, "metrics": asdict(self.metrics)}
        return {**out, "skipped": self.skipped} if self.skipped else out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        metrics = PlanMetrics(**d["metrics"])
        return cls(d["method"], dict(d["options"]), metrics, str(d.get("skipped", "")))


@dataclass(frozen=True)
class LayerFigures:
    name: str
    shape: str
    blocks: int
    spread: int
    workers_used: int
    volume: int
    lower_bound: int
    imbalance: float
    compute_s: float
    exchange_s: float
    split: bool = True  # the runtime splits it to hide its halo (netpart.cost.overlap)
    hideable_s: float = 0.0  # the work its split could run beside its halo (busiest worker)
    # conv: the share of its outputs torch's convolution computes, the rest gathered patches
    convolved: float | None = None


@dataclass(frozen=True)
class WorkerFigures:
    worker: int
    flops: tuple[int, ...]
    params: int
    halo_in_bytes: int
    halo_out_bytes: int
    neighbours: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PartitionPlan:
    """A node map with its provenance and figures. Equal plans have equal JSON and node maps."""

    model: str
    fingerprint: str
    method: str
    workers: int
    seed: int
    options: dict[str, Any]
    batch: int
    network: Machine
    node_map: np.ndarray
    metrics: PlanMetrics
    layers: tuple[LayerFigures, ...]
    per_worker: tuple[WorkerFigures, ...]
    candidates: tuple[Candidate, ...] = ()
    rule: str = ""  # with candidates: the rule `auto` chose by (netpart.partition.planner)
    schema_version: int = SCHEMA_VERSION

    @property
    def granularity(self) -> Granularity:
        return Granularity(**self.options["granularity"])

    @property
    def method_options(self) -> dict[str, Any]:
        """The options the method ran with (without the granularity of its graph)."""
        return {k: v for k, v in self.options.items() if k != "granularity"}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartitionPlan):
            return NotImplemented
        return self.to_dict() == other.to_dict() and np.array_equal(self.node_map, other.node_map)

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "seed": self.seed,
            "options": self.options,
            "workers": self.workers,
            "batch": self.batch,
            "network": self.network.to_dict(),
            "num_blocks": len(self.node_map),
            "metrics": asdict(self.metrics),
            "layers": [asdict(x) for x in self.layers],
            "per_worker": [asdict(x) for x in self.per_worker],
            **({"auto": self.auto_dict()} if self.candidates else {}),
        }

    def auto_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "candidates": [c.to_dict() for c in self.candidates]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, node_map: np.ndarray, source: str = "plan.json") -> PartitionPlan:
        """Parse `plan.json` text with its node map; raises PlanError naming what is wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"{source}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}"
            ) from None
        if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION:
            got = d.get("schema_version") if isinstance(d, dict) else None
            raise PlanError(
                f"{source}: schema_version {got!r} is not {SCHEMA_VERSION}; re-run `netpart plan`"
            )
        try:
            plan_ = cls(
                model=d["model"],
                fingerprint=d["fingerprint"],
                method=d["method"],
                workers=int(d["workers"]),
                seed=int(d["seed"]),
                options=d["options"],
                batch=int(d["batch"]),
                network=Machine.from_dict(d["network"]),
                node_map=np.asarray(node_map, dtype=np.int64),
                metrics=PlanMetrics(**d["metrics"]),
                layers=tuple(LayerFigures(**x) for x in d["layers"]),
                per_worker=tuple(
                    WorkerFigures(
                        **{**x, "flops": tuple(x["flops"]), "neighbours": tuple(x["neighbours"])}
                    )
                    for x in d["per_worker"]
                ),
                candidates=tuple(
                    Candidate.from_dict(c) for c in d.get("auto", {}).get("candidates", [])
                ),
                rule=str(d.get("auto", {}).get("rule", "")),
            )
            expected_blocks = int(d["num_blocks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"{source}: missing or invalid field ({exc}); re-run `netpart plan`"
            ) from None
        if plan_.node_map.ndim != 1 or len(plan_.node_map) != expected_blocks:
            raise PlanError(
                f"{source}: node_map.npy has {plan_.node_map.shape} entries, "
                f"plan.json expects {expected_blocks}"
            )
        if len(plan_.node_map) and (
            plan_.node_map.min() < 0 or plan_.node_map.max() >= plan_.workers
        ):
            raise PlanError(f"{source}: node_map.npy names workers outside 0..{plan_.workers - 1}")
        return plan_

    def check_model(self, spec: ModelSpec) -> None:
        """Raise PlanError unless this plan was made for `spec`'s architecture."""
        if spec.fingerprint() != self.fingerprint:
            raise PlanError(
                f"this plan is for model {self.model!r} (fingerprint {self.fingerprint}), not "
                f"{spec.name!r} (fingerprint {spec.fingerprint()}); re-run `netpart plan` for it"
            )


def plan_files(plan: PartitionPlan) -> dict[str, bytes]:
    """The bytes of `plan.json` and `node_map.npy` (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, plan.node_map.astype(np.int64), allow_pickle=False)
    return {"plan.json": plan.to_json().encode(), "node_map.npy": buf.getvalue()}


def load_plan(path: str | Path, spec: ModelSpec | None = None) -> PartitionPlan:
    """Read a plan directory (or its plan.json); with `spec`, refuse a plan for another model.
    (Reading files: the one effect of this room, at the edge of every command that takes
    --plan.)"""
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
