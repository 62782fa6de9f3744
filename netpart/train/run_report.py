"""What a finished (or stopped) run directory says: metrics, held-out figures, plots, report.

Inputs, all in the run directory: `metrics_replica<r>.jsonl` (one line per step from worker 0
of replica r: step, replica, time, loss, accuracy, staleness, samples, step_s, compute_s,
halo_s, ps_s, data_s, halo_bytes, ps_bytes), the shards' `shard_<s>.json` sidecars (their
staleness histograms: updates applied between serving a worker its parameters and applying
the gradient computed on them) and `summary.json`. Outputs: `metrics.jsonl` (every replica's
lines in time order), `curves.png`, `step_time.png`, `staleness.png` and `report.md`. Every
file is written to a temporary name and renamed.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

from netpart.files import write_atomic
from netpart.models.spec import ModelSpec

__all__ = [
    "evaluate",
    "preload_plotting",
    "read_metrics",
    "restart_line",
    "staleness_histogram",
    "write_report",
]

log = logging.getLogger(__name__)

PARTS = ("compute_s", "halo_s", "ps_s", "data_s")
PART_NAMES = {
    "compute_s": "compute",
    "halo_s": "halo exchange (incl. waiting)",
    "ps_s": "parameter server",
    "data_s": "data",
    "other": "other",
}


def read_metrics(run: Path) -> list[dict]:
    """Every replica's metrics lines, in time order (a torn last line is skipped)."""
    lines = []
    for path in sorted(run.glob("metrics_replica*.jsonl")):
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue  # a line being written when the process died
    return sorted(lines, key=lambda x: (x.get("time", 0.0), x.get("replica", 0)))


def staleness_histogram(run: Path) -> collections.Counter[int]:
    """Pushes per staleness value, summed over the shards' final sidecars."""
    total: collections.Counter[int] = collections.Counter()
    for path in sorted(run.glob("shard_*.json")):
        try:
            meta = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for k, v in meta.get("staleness", {}).items():
            total[int(k)] += int(v)
    return total


@torch.no_grad()
def evaluate(
    spec: ModelSpec, state: dict, x: np.ndarray, y: np.ndarray, seed: int = 0, batch: int = 256
) -> dict:
    """Loss and accuracy (softmax models) of the reference module holding `state` on (x, y)."""
    from netpart.models.reference import build_reference

    model = build_reference(spec, seed)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()  # batch norms: their running statistics
    loss_sum, correct = 0.0, 0
    for lo in range(0, len(x), max(1, batch)):
        xb = torch.from_numpy(np.ascontiguousarray(x[lo : lo + batch])).float()
        yb = torch.from_numpy(y[lo : lo + batch])
        out = model(xb)
        loss_sum += float(model.loss(out, yb)) * len(xb)
        if spec.loss == "cross_entropy":
            correct += int((out.flatten(1).argmax(1) == yb).sum())
    result = {"examples": len(x), "loss": loss_sum / len(x)}
    if spec.loss == "cross_entropy":
        result["accuracy"] = correct / len(x)
    return result


def write_report(run: Path) -> Path:
    """Write metrics.jsonl, the PNG plots and report.md of `run`; returns report.md's path."""
    lines = read_metrics(run)
    write_atomic(run / "metrics.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())
    hist = staleness_histogram(run)
    summary = _read_json(run / "summary.json")
    train = _read_json(run / "train.json")
    images = _plots(run, lines, hist, train.get("config", {}).get("mode", "downpour"))
    text = _markdown(run, lines, hist, summary, train, images)
    write_atomic(run / "report.md", text.encode())
    return run / "report.md"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _by_replica(lines: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = collections.defaultdict(list)
    for x in lines:
        out[int(x.get("replica", 0))].append(x)
    return dict(sorted(out.items()))


def _smooth(v: np.ndarray, window: int) -> np.ndarray:
    if len(v) < window or window < 2:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    head = c[1:window] / np.arange(1, window)
    return np.concatenate([head, (c[window:] - c[:-window]) / window])


def _breakdown(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each part, and `other` (the rest of the step)."""
    if not rows or "step_s" not in rows[0]:
        return {}
    rows = rows[1:] if len(rows) > 10 else rows  # the first step includes warm-up
    mean = {p: float(np.mean([x.get(p, 0.0) for x in rows])) for p in PARTS}
    mean["other"] = max(0.0, float(np.mean([x["step_s"] for x in rows])) - sum(mean.values()))
    return mean


def preload_plotting() -> threading.Thread:
    """Import matplotlib in a background thread that runs only on an idle core (SCHED_IDLE):
    the launcher waits while its job trains, and the report's plots then cost their drawing,
    not 0.5 s of imports more."""

    def load() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: a plain import
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        _pyplot()

    thread = threading.Thread(target=load, name="preload-plotting", daemon=True)
    thread.start()
    return thread


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plots(run: Path, lines: list[dict], hist, mode: str) -> list[str]:
    plt = _pyplot()

    written = []
    reps = _by_replica(lines)
    if reps:
        written.append(_curves(plt, run, lines, reps))
        parts = {r: _breakdown(rows) for r, rows in reps.items()}
        if all(parts.values()):
            height = 1.6 + 0.5 * len(parts)
            fig, ax = plt.subplots(figsize=(7, height))
            fig.subplots_adjust(left=0.14, right=0.97, top=1 - 0.1 / height, bottom=0.85 / height)
            left = np.zeros(len(parts))
            for p in (*PARTS, "other"):
                ms = np.array([parts[r][p] * 1e3 for r in parts])
                ax.barh([f"replica {r}" for r in parts], ms, left=left, label=PART_NAMES[p])
                left += ms
            ax.set(xlabel="mean step time of worker 0 (ms)")
            fig.legend(ncol=5, fontsize="small", loc="lower center")
            written.append(_save(fig, run / "step_time.png"))
    if hist:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        fig.subplots_adjust(left=0.13, right=0.97, top=0.9, bottom=0.15)
        ks = np.array(sorted(hist))
        ax.bar(ks, [hist[k] for k in ks], width=0.8)
        mean = sum(k * v for k, v in hist.items()) / sum(hist.values())
        ax.set(
            xlabel="staleness (updates applied between fetch and push)",
            ylabel="pushes",
            title=f"{mode}: mean staleness {mean:.2f}, max {max(hist)}",
        )
        ax.grid(alpha=0.3, axis="y")
        written.append(_save(fig, run / "staleness.png"))
    return written


def _curves(plt, run: Path, lines: list[dict], reps: dict) -> str:
    """curves.png: training loss (log scale) and accuracy per replica, and the held-out
    figures of eval.jsonl, against the samples trained on (all replicas), wall time above."""
    order = np.argsort([x["time"] for x in lines], kind="stable")
    times = np.array([lines[i]["time"] for i in order])
    seen = np.cumsum([lines[i].get("samples", 0) for i in order])
    t0 = times[0]

    def samples_at(t):
        return np.interp(t, times, seen)

    held = [json.loads(x) for x in _text(run / "eval.jsonl").splitlines() if x.strip()]
    has_acc = any(x.get("accuracy") is not None for x in lines)
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(11 if has_acc else 6, 4))
    fig.subplots_adjust(
        left=0.085 if has_acc else 0.15, right=0.98, top=0.8, bottom=0.12, wspace=0.2
    )
    axes = np.atleast_1d(axes)
    for r, rows in reps.items():
        x = samples_at(np.array([row["time"] for row in rows]))
        loss = np.array([row["loss"] for row in rows], dtype=float)
        (ln,) = axes[0].plot(x, _smooth(loss, 20), label=f"replica {r} (mean of 20 steps)")
        axes[0].plot(x, loss, color=ln.get_color(), alpha=0.2, linewidth=0.8)
        if has_acc:
            acc = np.array([row.get("accuracy") or 0.0 for row in rows], dtype=float)
            axes[1].plot(x, _smooth(acc, 20), color=ln.get_color(), label=f"replica {r}")
    if held:
        x = samples_at(np.array([h["time"] for h in held]))
        label = f"held-out during training ({held[-1]['examples']} examples)"
        axes[0].plot(x, [h["loss"] for h in held], "ko-", markersize=3, label=label)
        if has_acc and "accuracy" in held[0]:
            axes[1].plot(x, [h["accuracy"] for h in held], "ko-", markersize=3, label=label)
    positive = all(row["loss"] > 0 for row in lines)
    axes[0].set_yscale("log" if positive else "symlog")
    axes[0].set(xlabel="samples trained on (all replicas)", ylabel="loss")
    if has_acc:
        axes[1].set(xlabel="samples trained on (all replicas)", ylabel="accuracy")
        axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        if len(times) > 1 and seen[-1] > seen[0]:  # wall time on the top axis
            top = ax.secondary_xaxis("top", functions=_time_axis(seen, times - t0))
            top.set_xlabel("wall time (s)")
    fig.suptitle(f"{run.name}: loss and accuracy per replica")
    return _save(fig, run / "curves.png")


def _time_axis(seen: np.ndarray, elapsed: np.ndarray) -> tuple:
    """Samples -> seconds and back, for a secondary axis (both ascend together)."""
    return (lambda s: np.interp(s, seen, elapsed), lambda t: np.interp(t, elapsed, seen))


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    # Each figure sets its margins itself: a layout engine (constrained, tight) measures every
    # text before drawing, and cost more than the drawing on a short job's report.
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path.name


def _markdown(run, lines, hist, summary, train, images) -> str:
    cfg = train.get("config", {})
    reps = _by_replica(lines)
    out = [f"# Training run `{run}`", ""]
    if train:
        out += [
            f"{train.get('model')}: {cfg.get('replicas')} replica(s) x {train.get('workers')} "
            f"model worker(s) + {cfg.get('shards')} parameter-server shard(s); {cfg.get('mode')}, "
            f"{cfg.get('optimizer')} lr {cfg.get('lr')}, batch {cfg.get('batch')}, data "
            f"`{cfg.get('data')}`, {cfg.get('dtype')}.",
            "",
        ]
    if lines:
        out += _metrics_lines(lines, reps)
    if hist:
        n = sum(hist.values())
        values = np.repeat(np.array(sorted(hist)), [hist[k] for k in sorted(hist)])
        out.append(
            f"- Staleness over {n:,} pushes: mean {values.mean():.2f}, median "
            f"{np.median(values):.0f}, 95th percentile {np.percentile(values, 95):.0f}, "
            f"max {values.max()} updates."
        )
    held = summary.get("held_out")
    if held:
        acc = f", accuracy **{held['accuracy']:.4f}**" if "accuracy" in held else ""
        out.append(f"- Held-out: {held['examples']} examples, loss {held['loss']:.4f}{acc}.")
    for r, why in summary.get("lost", {}).items():
        out.append(f"- Replica {r} was lost: {why}")
    out += [f"- {restart_line(x)}." for x in summary.get("restarts", [])]
    out += ["", *[f"![{name}]({name})" for name in images], ""]
    return "\n".join(out)


def _metrics_lines(lines: list[dict], reps: dict) -> list[str]:
    """Per replica its steps, loss, accuracy and step time; throughput, bytes and where
    worker 0's step went."""
    wall = max(x["time"] for x in lines) - min(x["time"] for x in lines)
    samples = sum(x.get("samples", 0) for x in lines)
    out = [
        "| replica | steps | loss (last 10%) | train accuracy (last 10%) | step ms |",
        "|---|---|---|---|---|",
    ]
    for r, rows in reps.items():
        tail = rows[-max(1, len(rows) // 10) :]
        acc = [x["accuracy"] for x in tail if x.get("accuracy") is not None]
        acc_s = f"{np.mean(acc):.3f}" if acc else "-"
        step_ms = np.mean([x.get("step_s", np.nan) for x in rows]) * 1e3
        out.append(
            f"| {r} | {rows[-1]['step']} | {np.mean([x['loss'] for x in tail]):.4f} | "
            f"{acc_s} | {step_ms:.1f} |"
        )
    halo = sum(x.get("halo_bytes", 0) for x in lines)
    ps = sum(x.get("ps_bytes", 0) for x in lines)
    out += [
        "",
        f"- Throughput: {samples:,} samples in {wall:.1f} s of metrics "
        f"({samples / wall if wall > 0 else float('nan'):.0f} samples/s over all replicas).",
        f"- Bytes moved: {halo / 1e6:.1f} MB halo exchange, {ps / 1e6:.1f} MB to and from "
        "the parameter server.",
    ]
    parts = _breakdown(lines)
    if parts:
        total = sum(parts.values())
        shares = ", ".join(
            f"{PART_NAMES[p]} {v * 1e3:.1f} ms ({v / total:.0%})" for p, v in parts.items()
        )
        out.append(f"- Step time of worker 0, mean over replicas: {shares}.")
    return out


def restart_line(restart: dict) -> str:
    """A shard restart of a run's summary, in words: what died and what it lost."""
    lost = restart["lost_steps"]
    steps = ", ".join(f"replica {r}: {n}" for r, n in lost.items())
    return (
        f"Shard {restart['shard']} {restart['exit']} and was restarted from its checkpoint "
        f"at update {restart['checkpoint_updates']}; the steps whose updates to it were lost: "
        f"{steps} ({sum(lost.values())} in all)"
    )
