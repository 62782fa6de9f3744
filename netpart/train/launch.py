"""`train`: run a whole training job — on this machine, or as one of torchrun's processes.

On this machine (`train`): everything is validated first (plan, layout, resume directory and
checkpoints), the run directory is written, and only then do R x N workers + S shards (+ a
coordinator) start, through the one launcher (`netpart.processes.launcher`), watched by the
fault policy of `netpart.train.supervise`: a worker that fails takes only its replica down; a
shard that dies is restarted from its last checkpoint with the whole job (up to
`config.cluster.restarts` times); a shard that reports an error, or the coordinator, stops the job
with the last checkpoint intact. A signal stops every process at a step boundary and the
shards write final checkpoints.

Under torchrun (`train_under_torchrun`): every process joins the group, learns its role from
the placement and plays it; shard 0 validates and writes the run directory first (and tells
every rank if that failed), and writes the model, summary and report at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.compile.compiled import compile_plan
from netpart.errors import TrainError
from netpart.files import write_atomic
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan
from netpart.processes.launcher import join_group, torchrun_attempt
from netpart.processes.zygote import Preloaded
from netpart.train.config import TrainConfig
from netpart.train.loggers import MetricLoggers
from netpart.train.placement import SHARD, WORKER
from netpart.train.process import (
    PS_TIMEOUT,
    compute_setup,
    job_placement,
    log_as,
    play_role,
    split_min_flops,
    stop_on_signals,
)
from netpart.train.run_report import preload_plotting, restart_line
from netpart.train.rundir import (
    Job,
    RunLock,
    TrainSummary,
    finish_run,
    prepare_run,
    read_progress,
    write_run,
)
from netpart.train.supervise import Attempt, lost_updates, record_restart, supervise
from netpart.train.watch import exit_text, resume_hint

__all__ = ["ProgressLines", "TrainSummary", "postfix", "train", "train_under_torchrun"]

log = logging.getLogger(__name__)

Echo = Callable[[str], None]
PROGRESS_EVERY_S = 10.0  # a progress line under torchrun, where no bar can be drawn
_HELD: list[RunLock] = []  # under torchrun, the first shard's lock on the run directory


def train(
    spec: ModelSpec,
    plan: PartitionPlan,
    config: TrainConfig,
    run: Path,
    resume: bool = False,
    on_progress=None,
    preloaded: Preloaded | None = None,
    initial: dict | None = None,
) -> TrainSummary:
    """Train `spec` partitioned by `plan` with `config` in processes on this machine.

    `on_progress(done_steps, stats, total_steps)` is called as replica losses arrive; `stats`
    holds the mean latest loss, samples/s, step time (ms) and MB moved so far. Raises TrainError
    for bad input (before any process starts) and WorkerFailure when a shard fails (past its
    restarts) or every replica is lost. `preloaded` (started early, on
    `netpart.train.process`) forks the first attempt's processes; without it one is started.
    """
    _check_initial(config, initial, resume)
    _check_dropout(spec, config)
    compiled = compile_plan(spec, plan, shards=config.cluster.shards)
    starts = prepare_run(compiled, config, run, resume)
    write_run(spec, plan, config, run, starts, resume, initial)
    preload_plotting()  # for the report, on whatever core the job leaves idle
    summary = TrainSummary(run=run)
    t0 = time.monotonic()
    total = sum(config.run.steps - starts.get(r, 0) for r in range(config.cluster.replicas))
    loggers = MetricLoggers(run, config.loggers) if config.loggers else None
    try:
        _attempts(
            spec,
            plan,
            config,
            run,
            (resume, total, starts),
            summary,
            on_progress,
            preloaded,
            loggers,
        )
    finally:
        if loggers is not None:
            loggers.close()
    summary.wall_s = time.monotonic() - t0
    finish_run(compiled, config, run, summary)
    return summary


def _check_dropout(spec: ModelSpec, config: TrainConfig) -> None:
    """Sandblaster's L-BFGS evaluates one function at many points: dropout would make each
    evaluation another function."""
    if spec.dropout_layers and config.cluster.mode == "sandblaster":
        raise TrainError(
            f"{spec.name}: layer {spec.dropout_layers[0]} has dropout, and Sandblaster's L-BFGS "
            "evaluates one fixed function; train it with --mode downpour or sync"
        )


def _check_initial(config: TrainConfig, initial: dict | None, resume: bool) -> None:
    """A new --init module job needs the module's weights (`initial`), and only it does."""
    if resume or (config.model.init == "module") == (initial is not None):
        return
    if initial is None:
        raise TrainError("--init module: the job was given no weights of the module to start from")
    raise TrainError("initial weights were given to a job of --init seed (netpart's own)")


def _attempts(spec, plan, config, run, how, summary, on_progress, preloaded, loggers) -> None:
    """Start the job's processes, and again from the checkpoints after a shard died (up to
    `config.cluster.restarts` times); `how`: (resume, total steps, each replica's start)."""
    resume, total, starts = how
    for number in range(config.cluster.restarts + 1):
        first = preloaded if number == 0 else None  # forks one attempt's processes
        attempt = Attempt(
            number,
            resume=resume or number > 0,
            total=total,
            on_progress=on_progress,
            preloaded=first,
            loggers=loggers,
        )
        died = supervise(run, plan.workers, config, summary, attempt)
        if died is None:
            break
        starts = read_progress(run, config.cluster, newest=True)
        lost_steps = []
        for s in died.shards:
            lost = lost_updates(run, s, starts, config.cluster.mode == "sync", died.exit_text(s))
            record_restart(run, lost)
            lost_steps.append(lost["lost_steps"])
        log.warning(
            "%s %s: restarting the job from the last checkpoints (%d of %d); "
            "the lost steps per replica: %s",
            died.blame,
            "died" if died.blame.startswith("the") else exit_text(died.code),
            number + 1,
            config.cluster.restarts,
            "; ".join(
                f"shard {s}: {steps}" for s, steps in zip(died.shards, lost_steps, strict=True)
            ),
        )
        write_run(spec, plan, config, run, starts, resume=True)


def train_under_torchrun(
    spec: ModelSpec,
    plan: PartitionPlan,
    config: TrainConfig,
    run: Path,
    resume: bool,
    echo: Echo,
    initial: dict | None = None,
) -> int:
    """Play this torchrun process's role in the job; returns its exit code. Shard 0 writes
    the run files first and, once every shard has finished, the model, summary and report
    (the run directory must be shared by the machines)."""
    rank = int(os.environ["RANK"])
    _check_dropout(spec, config)
    _check_world(int(os.environ["WORLD_SIZE"]), config.world(plan.workers), config)
    cluster = config.cluster
    compute_setup(cluster.threads)
    join_group(PS_TIMEOUT)  # a signal before the job starts ends the process at once
    stop = stop_on_signals()
    placement = job_placement(config, plan.workers)
    log_as(f"{placement.name(rank)} (rank {rank})")
    first_shard = placement.shard_rank(0)
    # torchrun restarted the job (--max-restarts) after a process failed: go on from the
    # checkpoints, at the furthest step the shards recorded (as the local launcher does).
    restarted = torchrun_attempt() > 0
    resume = resume or (restarted and any(run.glob("shard_*.pt")))
    mine = rank == first_shard
    splits = split_min_flops(placement, rank)
    compiled = compile_plan(
        spec, plan, shards=cluster.shards, validate=mine, split_min_flops=splits
    )
    _check_initial(config, initial, resume)
    how = (resume, restarted, initial)
    _prepare_on_first_shard(compiled, config, run, how, mine, placement)
    starts = read_progress(run, cluster, newest=restarted) if resume else {}
    job = Job(spec, plan, config, run, resume, tuple(starts.items()))
    t0 = time.monotonic()
    role = placement.roles[rank]
    bar, on_step = _bar(config, starts.get(0, 0), rank, placement, echo)
    try:
        server = play_role(job, compiled, rank, stop, placement, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
        sys.stderr.flush()
    if role.kind == WORKER and role.worker == 0 and cluster.mode != "sandblaster":
        lines = (run / f"metrics_replica{role.replica}.jsonl").read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {"step": 0, "loss": float("nan")}
        echo(f"replica {role.replica}: step {last['step']}, loss {last['loss']:.4g}")
    elif rank == first_shard and server is not None:
        summary = TrainSummary(run=run, stopped=stop.is_set(), wall_s=time.monotonic() - t0)
        _finish_on_first_shard(compiled, config, run, summary, echo)
    elif role.kind == SHARD and server is None:  # not every shard finished: the job failed
        if rank == first_shard:
            log.error("a shard failed: %s", resume_hint(run, config))
        return 1
    return 0


def _check_world(world: int, needed: int, config: TrainConfig) -> None:
    """TrainError (one line) where torchrun started another number of processes than the
    job takes."""
    if world != needed:
        raise TrainError(
            f"torchrun started {world} processes; this job needs replicas x workers + shards"
            f"{' + 1 coordinator' if config.coordinators else ''} = {needed}"
        )


def _finish_on_first_shard(compiled, config, run: Path, summary: TrainSummary, echo) -> None:
    """Shard 0, once every shard has finished: the model, summary, report and logs."""
    finish_run(compiled, config, run, summary)
    if config.loggers:  # no launcher followed the lines: write them now
        loggers = MetricLoggers(run, config.loggers)
        loggers.replay()
        loggers.close()
    if summary.held_out:
        echo(held_out_line(summary.held_out, config.data.source))
    for restart in summary.restarts:
        echo(restart_line(restart))
    echo(f"wrote {run}/model.pt; report: {run}/report.md")


def _prepare_on_first_shard(compiled, config, run, how, mine: bool, placement) -> None:
    """Shard 0 validates the run directory and writes the run files (`how`: resume, restarted
    by torchrun, --init module's weights); its verdict reaches every rank as UTF-8 bytes in a
    tensor (nothing received is unpickled), so none waits for ever."""
    resume, restarted, initial = how
    status = b""
    if mine:
        try:
            _HELD.append(RunLock(run).__enter__())  # held until this process ends
            starts = prepare_run(compiled, config, run, resume, newest=restarted)
            if restarted:  # what each shard restored from an older checkpoint lost
                sync = config.cluster.mode == "sync"
                for s in range(config.cluster.shards):
                    lost = lost_updates(run, s, starts, sync, "died (torchrun restarted the job)")
                    if any(lost["lost_steps"].values()):
                        record_restart(run, lost)
            write_run(compiled.spec, compiled.plan, config, run, starts, resume, initial)
            write_atomic(run / "placement.json", json.dumps(placement.to_dict(), indent=1).encode())
        except Exception as exc:  # every rank must hear of it, or it would wait for ever
            status = str(exc).encode()[:4000] or type(exc).__name__.encode()
    message = torch.zeros(4096, dtype=torch.uint8)
    if status:
        message[: len(status)] = torch.frombuffer(bytearray(status), dtype=torch.uint8)
    dist.broadcast(message, src=placement.shard_rank(0))
    text = bytes(message.tolist()).rstrip(b"\0").decode(errors="replace")
    if text:
        raise TrainError(text)


def _bar(config: TrainConfig, start: int, rank: int, placement, echo: Echo):
    """The progress bar: on the process that is worker 0 of replica 0 (it writes that
    replica's metrics; on one machine, and usually on several, it is rank 0); where no bar
    can be drawn, a `ProgressLines` line every PROGRESS_EVERY_S through `echo`."""
    if rank != placement.worker_rank(0, 0) or config.cluster.mode == "sandblaster":
        return None, None
    from tqdm import tqdm

    total = config.run.steps - start
    bar = tqdm(total=total, desc="train", unit="step", disable=None)
    lines = ProgressLines(PROGRESS_EVERY_S, say=echo) if bar.disable else None
    done = [0]

    def on_step(line: dict) -> None:  # replica 0's steps
        done[0] += 1
        stats = {
            "loss": line["loss"],
            "samples_s": config.cluster.replicas * config.data.batch / max(line["step_s"], 1e-9),
            "step_ms": line["step_s"] * 1e3,
            "mb": (line["halo_bytes"] + line["ps_bytes"]) * done[0] / 1e6,
            "replicas": 1,  # replica 0's own steps
        }
        if lines is not None:  # not a terminal (torchrun, a testbed): a line now and then
            lines(done[0], stats, total)
            return
        bar.set_postfix_str(postfix(stats), refresh=False)
        bar.update(1)

    return bar, on_step


def postfix(stats: dict) -> str:
    """A progress bar's figures, each labelled: loss, samples/s, ms/step, the bytes the job
    has moved between its processes (halo and parameter server) and, for a local job, the
    memory its processes hold (`processes_memory`)."""
    text = (
        f"loss {stats['loss']:.4g}, {stats['samples_s']:.0f} samples/s, "
        f"{stats['step_ms']:.0f} ms/step, {stats['mb']:,.0f} MB moved"
    )
    if stats.get("memory_mb"):  # a local job's (a torchrun process sees its own alone)
        text += f", memory {stats['memory_mb']:,.0f} MB"
    return text


ETA_AFTER = 0.05  # of the steps: an ETA before them says more of start-up than of steps


class ProgressLines:
    """Progress where no bar can be drawn (CI, nohup, `> log`): one line on stdout every
    `every` seconds, and at the last step: steps per replica, loss, samples/s, the bytes
    moved, and once `ETA_AFTER` of the steps are done (at least 3 a replica), the ETA."""

    def __init__(self, every: float, *, say: Callable[[str], None], clock=time.monotonic) -> None:
        self.every, self.clock, self.say = every, clock, say
        self.start = self.last = clock()
        self.ended = False

    def __call__(self, done: int, stats: dict, total: int) -> None:
        now = self.clock()
        final = done >= total and not self.ended
        if not stats or (now - self.last < self.every and not final):
            return
        self.last, self.ended = now, done >= total
        replicas = stats.get("replicas", 1)
        line = f"replica steps {done // replicas}/{total // replicas}: {postfix(stats)}"
        if done < total and done >= max(ETA_AFTER * total, 3 * replicas):
            line += f", ETA {(now - self.start) / done * (total - done):.0f} s"
        self.say(line)
        sys.stdout.flush()


def held_out_line(held: dict, source: str) -> str:
    acc = f", accuracy {held['accuracy']:.4f}" if "accuracy" in held else ""
    return f"held-out {source} ({held['examples']} examples): loss {held['loss']:.4f}{acc}"
