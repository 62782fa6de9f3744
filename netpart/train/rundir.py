"""A training run's directory: what it holds, checked before a job starts, finished after.

Files (written atomically): `train.json` (schema in `netpart.train.config`), `spec.json`,
`plan.json` + `node_map.npy`, `start.json` (each replica's first step), the shard checkpoints
(`netpart.ps.checkpoint`), `metrics_replica<r>.jsonl`, for a model with batch norm
`statistics_w<k>.pt` (the running statistics replica 0's worker k holds, at the steps the
shards checkpoint and at the end), and at the end `model.pt`, `summary.json` and the report.

Batch norms' running statistics are not trained by gradients, so they do not live on the
parameter server: every replica's workers keep their own as torch's BatchNorm keeps them
(each channel's, on the workers holding a part of it), and replica 0's are the model's —
written with each checkpoint's step, read back by a resumed replica 0, and exported beside
the parameters (`model_from_shards`), as a single process training on replica 0's batches
would have them. `prepare_run` refuses, before anything is written, a resume of
another model, layout or optimizer, a corrupt checkpoint, or a fresh run into a directory that
holds one already; `finish_run` writes what a finished (or stopped) job leaves behind.

A run directory has one owner at a time: the job that trains in it holds an exclusive
`flock` on the directory itself for the job's life (the launcher on one machine; under
torchrun the first shard, which writes the run files). The lock is on the directory's own
file descriptor, so no file is added to it; the kernel drops it when the holder exits,
however it exits. A second job on the same directory is refused in one line naming the
holder's pid (read from /proc/locks).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from netpart.compile.compiled import CompiledPlan, compile_plan
from netpart.compile.shards import ShardLayout
from netpart.errors import DataError, NetpartError, RuntimeFailure, TrainError, WorkerFailure
from netpart.files import foreign_entries, open_append, write_atomic, write_files
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan, load_plan, plan_files
from netpart.ps.checkpoint import (
    export_state_dict,
    load_shard,
    read_statistics,
    save_model,
    shard_meta,
    shard_path,
)
from netpart.train.config import SCHEMA_VERSION, ClusterConfig, TrainConfig, layout_key
from netpart.train.run_report import evaluate, read_metrics, write_report

__all__ = [
    "Job",
    "Progress",
    "RunLock",
    "TrainSummary",
    "check_lost",
    "checkpoint_meta",
    "finish_run",
    "holder",
    "model_from_shards",
    "prepare_run",
    "read_initial",
    "read_job",
    "read_progress",
    "run_model",
    "user_state",
    "write_run",
]

log = logging.getLogger(__name__)

METRICS_TAIL_BYTES = 65536  # of a metrics file, read for its last step (a line is < 1 KB)


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
    restarts: list[dict] = field(default_factory=list)  # shards restarted, what each lost

    def to_dict(self) -> dict:
        return {
            "run": str(self.run),
            "steps": self.steps,
            "final_loss": self.final_loss,
            "lost": self.lost,
            "stopped": self.stopped,
            "wall_s": self.wall_s,
            "held_out": self.held_out,
            "restarts": self.restarts,
        }


def checkpoint_meta(spec: ModelSpec, plan: PartitionPlan, config: TrainConfig) -> dict:
    """What a shard checkpoint must agree with to be resumed by this job."""
    return {
        "schema_version": 1,
        "fingerprint": spec.fingerprint(),
        "layout": layout_key(plan, config.cluster.shards),
        "optimizer": config.optimiser.name,
        "dtype": config.run.dtype,
    }


@dataclass(frozen=True)
class Job:
    """What every process of a training job knows: the model, its plan, the config, the run
    directory, and (resuming) the step each replica restarts after."""

    spec: ModelSpec
    plan: PartitionPlan
    config: TrainConfig
    run: Path
    resume: bool = False
    starts: tuple[tuple[int, int], ...] = ()  # (replica, step it restarts after)
    # --init module: the user's module's initial weights (reference names), for initial.pt
    initial: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)


def read_job(run: Path, resume: bool = False) -> Job:
    """The job a run directory holds (train.json, spec.json, the plan files and, once a job
    started there, start.json): the one reader of a run directory; TrainError (one line)
    if it is not one."""
    if not (run / "train.json").exists():
        raise TrainError(f"{run}: no train.json there; is it a netpart run directory?")
    try:
        manifest = json.loads((run / "train.json").read_text())
        spec = ModelSpec.from_json((run / "spec.json").read_text(), str(run / "spec.json"))
        starts_file = run / "start.json"
        starts = json.loads(starts_file.read_text()) if starts_file.exists() else {}
    except (OSError, ValueError) as exc:
        raise TrainError(f"{run}: unreadable run files ({exc})") from None
    config = TrainConfig.from_dict(manifest.get("config"), str(run / "train.json"))
    plan = load_plan(run, spec)
    started = tuple(sorted((int(r), int(s)) for r, s in starts.items()))
    return Job(spec, plan, config, run, resume, started)


def read_initial(run: Path) -> dict[str, torch.Tensor]:
    """initial.pt: the weights a --init module run's shards start from (reference names)."""
    try:
        return torch.load(run / "initial.pt", weights_only=True)
    except Exception as exc:  # torch's message runs to many lines
        raise TrainError(f"{run / 'initial.pt'}: unreadable ({type(exc).__name__})") from None


def read_progress(run: Path, cluster: ClusterConfig, newest: bool = False) -> dict[int, int]:
    """Per replica of `cluster`, the step a resumed replica restarts after: the last step
    every shard has from it (downpour), or the last step every shard applied (sync: replicas
    move together, and one added on resume joins them there). `newest`: the furthest any
    shard recorded (a restart after a shard died: its updates since its checkpoint are lost,
    not redone).
    Read from the checkpoints themselves (`shard_meta`); TrainError if one is missing or
    unreadable (a run is never read as being at step 0)."""
    out = {r: 0 for r in range(cluster.replicas)}
    pick, sync = (max if newest else min), cluster.mode == "sync"
    for s in range(cluster.shards):
        meta = shard_meta(run, s)
        prog = {int(r): int(v) for r, v in meta.get("progress", {}).items()}
        for r in out:
            mine = int(meta.get("clock", 0)) if sync else prog.get(r, 0)
            out[r] = mine if s == 0 else pick(out[r], mine)
    return out


def run_model(run: Path, from_shards: bool = False) -> tuple[Job, dict[str, torch.Tensor]]:
    """(the run's job, the reference `state_dict` it trained): its model.pt if there is one
    (unless `from_shards`), else rebuilt from the shard checkpoints."""
    job = read_job(run)
    if not from_shards and (run / "model.pt").exists():
        try:
            saved = torch.load(run / "model.pt", weights_only=True)
            names = {**job.spec.state_names(), **job.spec.buffer_names()}
            reference = {user: ours for ours, user in names.items()}
            return job, {reference.get(k, k): v for k, v in saved.items()}
        except Exception as exc:  # a torn or foreign file: torch's message runs to many lines
            raise TrainError(
                f"{run / 'model.pt'}: not a model file netpart wrote ({type(exc).__name__} from "
                f"torch.load); rebuild it from the shard checkpoints with `netpart export {run}`"
            ) from None
    compiled = compile_plan(job.spec, job.plan, shards=job.config.cluster.shards, validate=False)
    return job, model_from_shards(job.spec, job.plan, job.config, run, compiled.layout)


def user_state(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference `state_dict` under the names of the module `spec` was imported from (the
    reference's own for a zoo or spec model): what a run's model.pt holds."""
    names = {**spec.state_names(), **spec.buffer_names()}
    return {names.get(k, k): v for k, v in state.items()}


def model_from_shards(
    spec: ModelSpec, plan: PartitionPlan, config: TrainConfig, run: Path, layout: ShardLayout
) -> dict[str, torch.Tensor]:
    """The reference `state_dict` of a run, from its shard checkpoints (each one checked)
    and its batch norms' running statistics (`read_statistics`)."""
    meta = checkpoint_meta(spec, plan, config)
    values = [load_shard(run, s, meta, int(n)).values for s, n in enumerate(layout.shard_sizes())]
    state = export_state_dict(spec, layout, values)
    kept, _ = read_statistics(run, spec, plan.workers)
    for name, value in kept.items():
        state[name] = value.to(state[name].dtype)
    return state


def prepare_run(
    compiled: CompiledPlan,
    config: TrainConfig,
    run: Path,
    resume: bool,
    newest: bool = False,
) -> dict[int, int]:
    """Check the job and the run directory; return each replica's start step.

    Raises TrainError (nothing written) for a resume directory of another model, layout or
    optimizer, a corrupt checkpoint, or a fresh run into a directory holding one already.
    """
    spec, plan, layout = compiled.spec, compiled.plan, compiled.layout
    _refuse_links(run)
    if resume:
        _cut_torn_lines(run)
        old = read_job(run).config
        meta = checkpoint_meta(spec, plan, config)
        for s in range(config.cluster.shards):  # every checkpoint loads before anything is written
            load_shard(run, s, meta, int(layout.shard_sizes()[s]))
        if old.cluster.replicas != config.cluster.replicas:
            log.info(
                "resuming with %d replicas (was %d)", config.cluster.replicas, old.cluster.replicas
            )
        starts = read_progress(run, config.cluster, newest)
        if config.cluster.mode != "sandblaster":  # its iterations are logged by the coordinator
            _say_unlogged(run, {r: n for r, n in starts.items() if r < old.cluster.replicas})
    else:
        if _resumable(run):
            raise TrainError(
                f"--out {run}: already holds a training run; continue it with --resume {run} "
                "or choose another --out directory"
            )
        if found := foreign_entries(run, "train.json"):
            raise TrainError(
                f"--out {run}: not empty and not a training run (holds {', '.join(found)}); "
                "choose a new or empty directory"
            )
        if (run / "train.json").exists():  # a job that ended before every shard's checkpoint
            log.warning("%s: its run has no checkpoint of every shard; starting it afresh", run)
            for name in RUN_OUTPUTS:
                for path in run.glob(name):
                    path.unlink(missing_ok=True)
        starts = dict.fromkeys(range(config.cluster.replicas), 0)
    return starts


def _resumable(run: Path) -> bool:
    """Whether `run` holds a run every shard of which wrote a checkpoint (one that did not
    cannot be resumed, and a new job may start over in it)."""
    try:
        shards = read_job(run).config.cluster.shards
    except (NetpartError, OSError, ValueError):
        return any(run.glob("shard_*.pt"))  # unreadable: leave it to the other checks
    return any(run.glob("shard_*.pt")) and all(shard_path(run, s).exists() for s in range(shards))


def _say_unlogged(run: Path, starts: dict[int, int]) -> None:
    """Warn of the steps a replica trained into every checkpoint without a metrics line of
    their own: a job killed between a shard's checkpoint and the replica's line (or a torn
    last line cut). The resume goes on after them; its metrics and report go without them."""
    for r, start in starts.items():
        last = _last_logged_step(run / f"metrics_replica{r}.jsonl")
        if start > last:
            steps = f"step {start}" if start == last + 1 else f"steps {last + 1}-{start}"
            log.warning(
                "replica %d: %s trained (the checkpoints hold their updates) but not logged "
                "(the job ended before their metrics lines were written); the metrics and "
                "the report go on without them",
                r,
                steps,
            )


def _last_logged_step(path: Path) -> int:
    """The step of the last whole line of a metrics file (0: no file, or no line yet)."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - METRICS_TAIL_BYTES))
            tail = fh.read()
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # torn, or the first line's cut end
    return 0


def _cut_torn_lines(run: Path) -> None:
    """Cut the torn last line a killed writer left in a line file of the run (the metrics,
    the held-out evaluations), before any process appends to it or the launcher reads it."""
    for pattern in ("metrics_replica*.jsonl", "eval.jsonl", "sandblaster.jsonl", "*.csv"):
        for path in run.glob(pattern):
            os.close(open_append(path, lines=True))


def _refuse_links(run: Path) -> None:
    """TrainError if the run directory, or its logs, hold a symbolic link: a job writes and
    appends only to files of its own, and following a link would write outside it."""
    logs = run / "logs"
    entries = list(run.iterdir()) if run.is_dir() else []
    if logs.is_dir() and not logs.is_symlink():
        entries += logs.iterdir()
    links = sorted(str(p) for p in entries if p.is_symlink())
    if links:
        raise TrainError(
            f"{links[0]}: a symbolic link in the run directory; netpart writes only files of "
            "its own there: replace it with the file itself or remove it"
        )


# What a job writes into its run directory (besides the logs), removed when a run that never
# wrote a checkpoint is started afresh.
RUN_OUTPUTS = (
    "train.json",
    "spec.json",
    "plan.json",
    "node_map.npy",
    "start.json",
    "placement.json",
    "metrics_replica*.jsonl",
    "metrics.jsonl",
    "eval.jsonl",
    "restarts.json",
    "summary.json",
    "shard_*.json",
    "coordinator.json",
    "sandblaster.jsonl",
    "metrics.csv",
    "eval.csv",
    "diverged_*.json",
    "data.json",
    "initial.pt",
    "shard_*.pt",  # a shard's checkpoint where not every shard wrote one
)


def write_run(
    spec, plan, config, run: Path, starts: dict[int, int], resume: bool, initial=None
) -> None:
    """The run's files: train.json, spec.json, the plan's, start.json and, with `initial`
    (--init module, a new run), initial.pt: the weights the shards start from."""
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "model": spec.name,
        "fingerprint": spec.fingerprint(),
        "layout": layout_key(plan, config.cluster.shards),
        "workers": plan.workers,
        "config": config.to_dict(),
    }
    files = {**plan_files(plan), "spec.json": spec.to_json().encode()}
    files["train.json"] = json.dumps(manifest, indent=1).encode()
    files["start.json"] = json.dumps({str(r): s for r, s in starts.items()}).encode()
    if initial is not None and not resume:
        buf = io.BytesIO()
        torch.save(initial, buf)
        files["initial.pt"] = buf.getvalue()
    write_files(run, files)
    for note in run.glob("diverged_*.json"):  # a new job: it has not diverged
        note.unlink()
    if not resume:
        for r in range(config.cluster.replicas):
            (run / f"metrics_replica{r}.jsonl").unlink(missing_ok=True)


def _check_diverged(run: Path, config: TrainConfig) -> None:
    """RuntimeFailure naming where the run can go on from, if training diverged (a shard
    then kept its last checkpoint and wrote `diverged_<s>.json`)."""
    notes = sorted(run.glob("diverged_*.json"))
    if not notes:
        return
    note = json.loads(notes[0].read_text())
    what = (
        f"replica {note['replica']}'s loss was not finite at step {note['step']}"
        if note["replica"] >= 0
        else "a shard's values were not finite"
    )
    if not all(shard_path(run, s).exists() for s in range(config.cluster.shards)):
        raise RuntimeFailure(
            f"training diverged: {what}, before the first checkpoint; start again with a "
            f"lower --lr than {config.optimiser.lr:g} (--out {run} is reused)"
        )
    steps = read_progress(run, config.cluster)
    at = ", ".join(f"replica {r} at step {s}" for r, s in steps.items())
    raise RuntimeFailure(
        f"training diverged: {what}; the checkpoints in {run} keep the last state before it "
        f"({at}): resume from there with a lower --lr than {config.optimiser.lr:g} (--resume {run})"
    )


def check_lost(summary: TrainSummary, config) -> None:
    """WorkerFailure when every replica was lost (what the launcher and the shards saw),
    unless the user stopped the job: its replicas then end as their links close (a shard
    killed as the stop came, say), and its checkpoints are what a resume goes on from."""
    if len(summary.lost) == config.cluster.replicas and not summary.stopped:
        raise WorkerFailure(
            "every replica was lost: "
            + "; ".join(f"replica {r}: {why}" for r, why in sorted(summary.lost.items()))
        )


def finish_run(compiled: CompiledPlan, config, run: Path, summary: TrainSummary) -> None:
    """After the job: model.pt from the shards, held-out figures, summary.json, the report."""
    spec, plan, layout = compiled.spec, compiled.plan, compiled.layout
    _check_diverged(run, config)
    for line in read_metrics(run):  # time order: the last line of a replica wins
        summary.steps[line["replica"]] = line["step"]
        summary.final_loss[line["replica"]] = line["loss"]
    restarts = run / "restarts.json"  # shards restarted from a checkpoint, what each lost
    summary.restarts = json.loads(restarts.read_text()) if restarts.exists() else []
    # replicas a shard dropped (under torchrun: the only record)
    for s in range(config.cluster.shards):
        if not shard_path(run, s).exists():  # the job ended before its first checkpoint
            continue
        for r, why in shard_meta(run, s).get("lost", {}).items():
            summary.lost.setdefault(int(r), why)
    check_lost(summary, config)
    state = model_from_shards(spec, plan, config, run, layout)
    if not all(bool(torch.isfinite(t).all()) for t in state.values()):
        raise RuntimeFailure(
            f"the trained parameters are not finite: training diverged; try a lower --lr "
            f"(model.pt and summary.json were not written to {run})"
        )
    # the result first: nothing after it can lose it (an imported model's, in its names)
    save_model(run / "model.pt", user_state(compiled.spec, state))
    write_atomic(run / "summary.json", json.dumps(summary.to_dict(), indent=1).encode())
    try:
        data = config.dataset(spec)
        # how a user's own model is fed and what its outputs mean (`netpart export` states it)
        write_atomic(run / "data.json", json.dumps(data.preprocessing(), indent=1).encode())
        summary.held_out = evaluate(spec, state, *data.held_out_set(), seed=config.run.seed)
    except (DataError, OSError) as exc:  # the data went away during the run
        log.warning("no held-out evaluation: %s", exc)
    if summary.held_out and not math.isfinite(summary.held_out["loss"]):
        log.warning("the model's held-out loss is %s: training diverged", summary.held_out["loss"])
    write_atomic(run / "summary.json", json.dumps(summary.to_dict(), indent=1).encode())
    write_report(run)


class Progress:
    """Steps logged since it was made, and running figures for a progress bar: reads only
    what the metrics files gained since the last call (a resumed run's earlier lines are
    neither counted nor read again)."""

    def __init__(self, run: Path, replicas: int, loggers=None) -> None:
        """`loggers` (`netpart.train.loggers.MetricLoggers`) hears of every new line, the
        held-out evaluations' (eval.jsonl) included."""
        self.paths = [run / f"metrics_replica{r}.jsonl" for r in range(replicas)]
        self.paths.append(run / "eval.jsonl")  # the last: evaluations, not steps
        self.offsets = [p.stat().st_size if p.exists() else 0 for p in self.paths]
        self.partial = [b""] * len(self.paths)
        self.loggers = loggers
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
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError:  # a line a killed writer tore: not a step
                    continue
                if i == len(self.paths) - 1:
                    if self.loggers is not None:
                        self.loggers.eval_line(line)
                    continue
                if self.loggers is not None:
                    self.loggers.train_line(line)
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
                "replicas": len(self.paths) - 1,
            }
        return self.steps, stats


def holder(run: Path) -> int | None:
    """The pid holding a flock on directory `run` (from /proc/locks), or None."""
    try:
        st = os.stat(run)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF" (a "->" marks a waiter)
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5].lower() == want:
            return int(fields[4])
    return None


class RunLock:
    """Hold run directory `run` (created if missing) for a `with` block; TrainError, one
    line, if another job holds it."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.run.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = holder(self.run)
            who = f"netpart pid {pid}" if pid is not None else "another netpart job"
            raise TrainError(
                f"{self.run}: in use by {who}, which trains in it now; wait for it to end (or "
                "stop it), or choose another --out directory"
            ) from None
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
