"""`train`: run a whole training job on this machine (R x N model workers + S shards).

The launcher validates everything first (plan, layout, resume directory and checkpoints) and
writes the run directory; only then does it host the rendezvous store and start the processes.
Its fault policy follows DistBelief: a worker that fails takes only its replica down (its mates
are given `timeout` to notice, then killed) and training goes on; a shard that fails stops the
job, with the last checkpoint intact. SIGTERM or SIGINT is passed on to every process, which
stop at a step boundary, and the shards write final checkpoints. Every process is joined or
killed on every exit path, and dies with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import datetime
import json
import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from netpart.data import load_data
from netpart.files import plan_files, write_atomic, write_files
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.partition.shards import ShardLayout
from netpart.runtime.checkpoint import (
    checkpoint_meta,
    load_shard,
    model_from_shards,
    read_progress,
    read_run,
    save_model,
    shard_path,
)
from netpart.runtime.config import SCHEMA_VERSION, TrainConfig, TrainError, layout_key
from netpart.runtime.launch import WorkerFailure, _last_error, spawn
from netpart.runtime.run_report import evaluate, read_metrics, write_report
from netpart.runtime.schedule import plan_schedule

__all__ = ["TrainSummary", "finish_run", "prepare_run", "train"]

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """How a job ended: per replica its last step and loss, which replicas were lost."""

    run: Path
    steps: dict[int, int] = field(default_factory=dict)
    final_loss: dict[int, float] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    stopped: bool = False
    wall_s: float = 0.0
    held_out: dict | None = None  # loss, accuracy and examples of the held-out set

    def to_dict(self) -> dict:
        return {
            "run": str(self.run),
            "steps": self.steps,
            "final_loss": self.final_loss,
            "lost": self.lost,
            "stopped": self.stopped,
            "wall_s": self.wall_s,
            "held_out": self.held_out,
        }


def prepare_run(
    spec: ModelSpec, plan: PartitionPlan, config: TrainConfig, run: Path, resume: bool
) -> tuple[ShardLayout, dict[int, int]]:
    """Check the job and the run directory; return the layout and each replica's start step.

    Raises TrainError (nothing written) for a resume directory of another model, layout or
    optimizer, a corrupt checkpoint, or a fresh run into a directory holding one already.
    """
    graph, _ = plan_schedule(spec, plan)
    layout = ShardLayout.build(graph, plan.node_map, plan.workers, config.shards)
    if resume:
        _, _, old = read_run(run)
        meta = checkpoint_meta(spec, plan, config)
        for s in range(config.shards):  # every checkpoint must load before anything is written
            load_shard(run, s, meta, int(layout.shard_sizes()[s]))
        if old.replicas != config.replicas:
            log.info("resuming with %d replicas (was %d)", config.replicas, old.replicas)
        starts = read_progress(run, config.shards, config.replicas, config.mode == "sync")
    else:
        if shard_path(run, 0).exists() or (run / "train.json").exists():
            raise TrainError(
                f"--out {run}: already holds a training run; continue it with --resume {run} "
                "or choose another --out directory"
            )
        starts = dict.fromkeys(range(config.replicas), 0)
    return layout, starts


def _write_run(spec, plan, config, run: Path, starts: dict[int, int], resume: bool) -> None:
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "model": spec.name,
        "fingerprint": spec.fingerprint(),
        "layout": layout_key(plan, config.shards),
        "workers": plan.workers,
        "config": config.to_dict(),
    }
    files = {**plan_files(plan), "spec.json": spec.to_json().encode()}
    files["train.json"] = json.dumps(manifest, indent=1).encode()
    files["start.json"] = json.dumps({str(r): s for r, s in starts.items()}).encode()
    write_files(run, files)
    if not resume:
        for r in range(config.replicas):
            (run / f"metrics_replica{r}.jsonl").unlink(missing_ok=True)


def train(
    spec: ModelSpec,
    plan: PartitionPlan,
    config: TrainConfig,
    run: Path,
    resume: bool = False,
    on_progress=None,
) -> TrainSummary:
    """Train `spec` partitioned by `plan` with `config` in processes on this machine.

    `on_progress(done_steps, stats, total_steps)` is called as replica losses arrive; `stats`
    holds the mean latest loss, samples/s, step time (ms) and MB moved so far. Raises TrainError
    for bad input (before any process starts) and WorkerFailure when a shard fails or every
    replica is lost.
    """
    layout, starts = prepare_run(spec, plan, config, run, resume)
    _write_run(spec, plan, config, run, starts, resume)
    world = config.world(plan.workers)
    wait = datetime.timedelta(seconds=max(60.0, config.timeout))
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=wait, wait_for_workers=False)
    summary = TrainSummary(run=run)
    t0 = time.monotonic()
    _supervise(run, plan.workers, config, store.port, resume, summary, starts, on_progress)
    summary.wall_s = time.monotonic() - t0
    finish_run(spec, plan, config, run, layout, summary)
    return summary


def finish_run(spec, plan, config, run: Path, layout, summary: TrainSummary) -> None:
    """After the job: model.pt from the shards, held-out figures, summary.json, the report."""
    for line in read_metrics(run):  # time order: the last line of a replica wins
        summary.steps[line["replica"]] = line["step"]
        summary.final_loss[line["replica"]] = line["loss"]
    for s in range(config.shards):  # replicas a shard dropped (under torchrun: the only record)
        meta = json.loads(shard_path(run, s).with_suffix(".json").read_text())
        for r, why in meta.get("lost", {}).items():
            summary.lost.setdefault(int(r), why)
    state = model_from_shards(spec, plan, config, run, layout)
    save_model(run / "model.pt", state)
    data = load_data(config.data, spec, config.seed, config.examples)
    summary.held_out = evaluate(spec, state, *data.held_out_set(), seed=config.seed)
    write_atomic(run / "summary.json", json.dumps(summary.to_dict(), indent=1).encode())
    write_report(run)


class _Progress:
    """Steps logged since it was made, and running figures for a progress bar: reads only
    what the metrics files gained since the last call (a resumed run's earlier lines are
    neither counted nor read again)."""

    def __init__(self, run: Path, replicas: int) -> None:
        self.paths = [run / f"metrics_replica{r}.jsonl" for r in range(replicas)]
        self.offsets = [p.stat().st_size if p.exists() else 0 for p in self.paths]
        self.partial = [b""] * replicas
        self.steps = self.samples = self.bytes = 0
        self.loss: dict[int, float] = {}
        self.step_s: dict[int, float] = {}
        self.t0 = time.monotonic()

    def __call__(self) -> tuple[int, dict]:
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[i])
                    new = fh.read()
            except OSError:
                continue
            self.offsets[i] += len(new)
            *complete, self.partial[i] = (self.partial[i] + new).split(b"\n")
            for raw in filter(bytes.strip, complete):
                line = json.loads(raw)
                self.steps += 1
                self.samples += line.get("samples", 0)
                self.bytes += line.get("halo_bytes", 0) + line.get("ps_bytes", 0)
                self.loss[i], self.step_s[i] = line["loss"], line.get("step_s", 0.0)
        stats = {}
        if self.loss:
            elapsed = max(1e-9, time.monotonic() - self.t0)
            stats = {
                "loss": sum(self.loss.values()) / len(self.loss),
                "samples_s": self.samples / elapsed,
                "step_ms": 1e3 * sum(self.step_s.values()) / len(self.step_s),
                "mb": self.bytes / 1e6,
            }
        return self.steps, stats


def _supervise(run, workers, config, port, resume, summary, starts, on_progress) -> None:
    world = config.world(workers)
    n_workers = config.replicas * workers
    logs = [run / "logs" / f"rank{r}.log" for r in range(world)]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    previous = {}

    def forward(signum, frame):
        if not stop.is_set():
            log.warning("signal %d: stopping every process at its next step boundary", signum)
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    total = sum(config.steps - starts.get(r, 0) for r in range(config.replicas))
    progress = _Progress(run, config.replicas)
    try:
        for rank in range(world):
            args = ["netpart.runtime.train_main", "--run", str(run)]
            # A new session: a terminal's Ctrl-C reaches the processes through the launcher.
            args += ["--resume"] if resume else []
            procs.append(spawn(args, rank, world, port, logs[rank], new_session=True))
        lost_at: dict[int, float] = {}
        shard_failed_at: float | None = None
        while [p.poll() for p in procs].count(None):  # poll every process, every round
            now = time.monotonic()
            for rank, p in enumerate(procs[:n_workers]):
                r = rank // workers
                if p.returncode not in (None, 0) and r not in summary.lost:
                    summary.lost[r] = (
                        f"worker {rank % workers} exited with code {p.returncode}: "
                        f"{_last_error(logs[rank])}"
                    )
                    log.warning("replica %d lost (%s); training goes on", r, summary.lost[r])
                    lost_at[r] = now
            for r, since in lost_at.items():  # mates of a lost worker get `timeout` to notice
                if now - since > config.timeout:
                    for p in procs[r * workers : (r + 1) * workers]:
                        if p.poll() is None:
                            p.kill()
            if shard_failed_at is None and any(
                p.returncode not in (None, 0) for p in procs[n_workers:]
            ):
                shard_failed_at = now
                forward(signal.SIGTERM, None)
            if shard_failed_at is not None and now - shard_failed_at > config.timeout:
                break
            if stop.is_set() and all(p.poll() is not None for p in procs[n_workers:]):
                break
            if on_progress is not None:
                on_progress(*progress(), total)
            time.sleep(0.1)
        if on_progress is not None:
            on_progress(*progress(), total)
    finally:
        deadline = time.monotonic() + (config.timeout if stop.is_set() else 0)
        for p in procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary.stopped = stop.is_set()
    failed = [
        (s, p.returncode) for s, p in enumerate(procs[n_workers:]) if p.returncode not in (0,)
    ]
    if failed:
        s, code = failed[0]
        who = "the coordinator" if s == config.shards else f"shard {s}"
        raise WorkerFailure(
            f"{who} exited with code {code}: {_last_error(logs[n_workers + s])}; the last "
            f"checkpoint is in {run} (continue with --resume {run})"
        )
    if len(summary.lost) == config.replicas:
        raise WorkerFailure(
            "every replica was lost: "
            + "; ".join(f"replica {r}: {why}" for r, why in summary.lost.items())
        )
