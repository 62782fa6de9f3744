"""StepResult: the outcome of one partitioned step, assembled in reference-module terms."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from netpart.files import write_atomic
from netpart.models.reference import ReferenceModel
from netpart.models.spec import ModelSpec
from netpart.runtime.state import WorkerResult

__all__ = ["StepResult", "assemble", "load_worker_result", "save_worker_result"]


@dataclass
class StepResult:
    """loss; outputs [B, *last shape]; grads keyed by the reference module's parameter names;
    sent/received[w][(layer, phase)] = bytes that worker w actually moved."""

    loss: float
    outputs: torch.Tensor
    grads: dict[str, torch.Tensor]
    sent: list[dict[tuple[int, str], int]]
    received: list[dict[tuple[int, str], int]]
    step_times: list[list[float]]  # per worker, per timed step (empty unless timed)
    compute_s: list[dict[tuple[int, str], float]]  # per worker, last step, per (layer, phase)
    exchange_s: list[dict[tuple[int, str], float]]  # exposed: posting and waiting
    hidden_s: list[dict[tuple[int, str], float]] = field(default_factory=list)  # overlapped
    breakdowns: list[list[dict[str, float]]] = field(default_factory=list)  # worker, step -> s
    threads: list[list[dict[str, float]]] = field(default_factory=list)  # worker, step -> s
    accuracy: float | None = None  # cross-entropy: share of the batch whose target logit is max
    # batch norms' running statistics by reference buffer name (each channel's from a worker
    # holding it: every holder computes the same)
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)

    def slowest_steps(self) -> np.ndarray:
        """Seconds of each timed step on its slowest worker (the step's wall time)."""
        return np.max(np.array(self.step_times), axis=0)


def assemble(
    spec: ModelSpec,
    results: list[WorkerResult],
    batch: int,
    dtype: torch.dtype,
    check_loss: bool = True,
) -> StepResult:
    """Combine the workers' slices: grads are index-added (tied conv kernels sum); missing
    workers' parts stay zero. With `check_loss`, all workers must report the same loss."""
    shapes = {name: p.shape for name, p in ReferenceModel(spec).named_parameters()}
    grads = {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}
    outputs = torch.zeros(batch, spec.shapes[-1].size, dtype=dtype)
    ordered = sorted(results, key=lambda r: r.rank)
    for r in ordered:
        for name, idx, values in r.grads:
            grads[name].view(-1).index_add_(
                0, torch.from_numpy(np.asarray(idx)), values.reshape(-1)
            )
        outputs[:, torch.from_numpy(r.output_units)] = r.outputs
    statistics: dict[str, torch.Tensor] = {}
    for r in ordered:
        for name, channels, values in r.statistics:
            channels_of = spec.shapes[int(name.split(".")[1])].channels
            held = statistics.setdefault(name, torch.zeros(channels_of, dtype=dtype))
            held[torch.from_numpy(np.asarray(channels))] = values.to(dtype)
    losses = {round(r.loss, 12) for r in results}
    if check_loss and len(losses) > 1:
        raise RuntimeError(f"workers disagree on the loss: {sorted(losses)}")
    last = spec.shapes[-1]
    out_shape = (
        (batch, last.channels) if last.height == last.width == 1 else (batch, *vars(last).values())
    )
    return StepResult(
        loss=results[0].loss,
        outputs=outputs.reshape(out_shape),
        grads=grads,
        sent=[r.sent for r in ordered],
        received=[r.received for r in ordered],
        step_times=[r.step_times for r in ordered],
        compute_s=[r.compute_s for r in ordered],
        exchange_s=[r.exchange_s for r in ordered],
        hidden_s=[r.hidden_s for r in ordered],
        accuracy=results[0].accuracy,
        statistics=statistics,
    )


_TIMINGS = ("compute_s", "exchange_s", "hidden_s")


def load_worker_result(path: Path) -> tuple[WorkerResult, list[dict], list[dict]]:
    """A worker's result file: (the last step's result, per-step breakdowns, per-step thread
    figures)."""
    d = torch.load(path, weights_only=True)
    timings: dict[str, dict] = {kind: {} for kind in _TIMINGS}
    for k, kind, v in zip(d["timing_keys"], d["timing_kind"], d["timing_s"], strict=True):
        timings[kind][(int(k[0]), k[1])] = float(v)
    result = WorkerResult(
        rank=int(d["rank"]),
        loss=float(d["loss"]),
        outputs=d["outputs"],
        output_units=d["output_units"].numpy(),
        grads=[
            (n, i.numpy(), v) for n, i, v in zip(d["names"], d["indices"], d["values"], strict=True)
        ],
        sent={(int(k[0]), k[1]): int(v) for k, v in zip(d["sent_keys"], d["sent"], strict=True)},
        received={
            (int(k[0]), k[1]): int(v) for k, v in zip(d["recv_keys"], d["received"], strict=True)
        },
        step_times=[float(t) for t in d["step_times"]],
        statistics=[
            (n, i.numpy(), v)
            for n, i, v in zip(
                d.get("stat_names", []),
                d.get("stat_indices", []),
                d.get("stat_values", []),
                strict=True,
            )
        ],
        **timings,
    )
    return (
        result,
        _rows(d["breakdown_keys"], d["breakdowns"]),
        _rows(d["thread_keys"], d["threads"]),
    )


def _rows(keys: list[str], table: torch.Tensor) -> list[dict[str, float]]:
    return [dict(zip(keys, map(float, row), strict=True)) for row in table.tolist()]


def _table(rows: list[dict[str, float]]) -> tuple[list[str], torch.Tensor]:
    keys = sorted(set().union(*rows)) if rows else []
    return keys, torch.tensor([[r.get(k, 0.0) for k in keys] for r in rows], dtype=torch.float64)


def save_worker_result(
    path: Path, r: WorkerResult, breakdowns: list[dict], threads: list[dict]
) -> None:
    """Write a worker's result (tensors, numbers and strings only: loads with weights_only)."""
    breakdown_keys, breakdown_table = _table(breakdowns)
    thread_keys, thread_table = _table(threads)
    timing = [(kind, k, v) for kind in _TIMINGS for k, v in getattr(r, kind).items()]
    buf = io.BytesIO()
    torch.save(
        {
            "rank": r.rank,
            "loss": r.loss,
            "outputs": r.outputs,
            "output_units": torch.from_numpy(r.output_units),
            "names": [n for n, _, _ in r.grads],
            "indices": [torch.from_numpy(np.asarray(i)) for _, i, _ in r.grads],
            "values": [v for _, _, v in r.grads],
            "stat_names": [n for n, _, _ in r.statistics],
            "stat_indices": [torch.from_numpy(np.asarray(i)) for _, i, _ in r.statistics],
            "stat_values": [v for _, _, v in r.statistics],
            "sent_keys": [[k[0], k[1]] for k in r.sent],
            "sent": list(r.sent.values()),
            "recv_keys": [[k[0], k[1]] for k in r.received],
            "received": list(r.received.values()),
            "step_times": list(r.step_times),
            "timing_keys": [[k[0], k[1]] for _, k, _ in timing],
            "timing_kind": [kind for kind, _, _ in timing],
            "timing_s": [v for _, _, v in timing],
            "breakdown_keys": breakdown_keys,
            "breakdowns": breakdown_table,
            "thread_keys": thread_keys,
            "threads": thread_table,
        },
        buf,
    )
    write_atomic(path, buf.getvalue())
