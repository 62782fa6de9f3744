"""`netpart train`'s one entry point: what the user asked (`TrainRequest`), the job's rules
that turn it into a `Job`, and the job run on this machine or as one of torchrun's processes.

The rules, applied before anything is written or any process starts: a fresh job needs a
model and a worker count; its data source is opened once (bad data fails before minutes of
planning), its plan is read (`--plan`) or made, and a job that cannot fit this machine is
refused. A resume reads the job from its run directory (`netpart.train.rundir.read_job`);
flags given override the run's config, except those that decide where every parameter lives
(`FIXED_ON_RESUME`), which must match it, and a Sandblaster run cannot be resumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netpart.cost.machine import Machine
from netpart.errors import PlanError, TrainError
from netpart.models import load_spec
from netpart.processes.memory import available_memory
from netpart.train.config import FLAT, TrainConfig
from netpart.train.loggers import check_loggers
from netpart.train.rundir import Job, RunLock, TrainSummary, read_job, read_progress

__all__ = [
    "DEFAULT_OUT",
    "FIELDS",
    "FIXED_ON_RESUME",
    "TrainRequest",
    "banner",
    "make_job",
    "train_here",
    "train_torchrun",
    "under_torchrun",
]

# The TrainConfig fields a command line may give, by their command-line names (all but the
# synthetic dataset's size).
FIELDS = tuple(name for name in FLAT if name != "examples")
FIXED_ON_RESUME = ("mode", "shards", "optimizer", "dtype", "seed", "data", "data_layout")
DEFAULT_OUT = Path("out/train")


@dataclass(frozen=True)
class TrainRequest:
    """What `netpart train` was asked, before the rules: the model and worker count (None on
    a resume), the config fields given (`FIELDS`), how to plan, where the run goes."""

    model: str | None = None
    input: str | None = None  # one example's shape, when `model` names a user's module
    workers: int | None = None
    given: dict[str, Any] = field(default_factory=dict)
    method: str = "auto"
    plan: Path | None = None
    network: Machine | None = None  # what `auto` predicts with (--profile)
    out: Path | None = None  # a new run's directory (default DEFAULT_OUT); not on a resume
    resume: Path | None = None
    force: bool = False  # start even far more processes than this machine has cores


def flag(name: str) -> str:
    """The command-line flag of a config field."""
    special = {"shards": "--ps-shards", "data_layout": "--layout"}
    return special.get(name, "--" + name.replace("_", "-"))


def make_job(request: TrainRequest, *, local: bool = True) -> Job:
    """The job `request` asks for (see the module docstring); `local`: every process on this
    machine (refuse a process count it cannot hold before planning)."""
    if request.resume is not None:
        return _resumed(request)
    if request.model is None or request.workers is None:
        raise TrainError("--model and --workers are required (or --resume DIR)")
    if request.workers < 1:
        raise TrainError(f"--workers {request.workers}: must be an integer >= 1")
    spec = load_spec(request.model, input=request.input)
    config = TrainConfig.of(**{"shards": request.workers, **request.given})
    spec.require_batch(config.data.batch)
    initial = _initial_weights(request.model, spec, config)
    check_loggers(config.loggers)  # a missing package fails before planning
    config.dataset(spec)  # bad data fails before planning
    if request.plan is not None:
        from netpart.partition.plans import load_plan

        p = load_plan(request.plan, spec)
        if p.workers != request.workers:
            raise PlanError(
                f"{request.plan}: the plan is for {p.workers} workers, not {request.workers}"
            )
        return Job(spec, p, config, request.out or DEFAULT_OUT, initial=initial)
    if local:  # thousands of processes are refused before minutes of planning
        from netpart.planning.memory import check_crowding, check_process_count

        what = f"--workers {request.workers} x --replicas {config.cluster.replicas}"
        processes = config.world(request.workers)
        check_process_count(processes, what, available=available_memory())
        # refused far beyond the cores; short of that, the banner says how they share them
        check_crowding(processes, what, cores=os.cpu_count() or 1, force=request.force)
    from netpart.partition import plan

    p = plan(
        spec,
        request.workers,
        request.method,
        seed=config.run.seed,
        batch=config.data.batch,
        network=request.network,
        memory=available_memory(),
    )
    return Job(spec, p, config, request.out or DEFAULT_OUT, initial=initial)


def _initial_weights(model: str, spec, config: TrainConfig):
    """With --init module, the user's module's own initial weights (built after
    `torch.manual_seed(--seed)`), under the reference's names; else None (netpart's seeded
    initialisation)."""
    if config.model.init != "module":
        return None
    from netpart.models import importer

    if not importer.is_module_target(model):
        raise TrainError(
            f"--init module: --model {model} is not a module; give --model FILE.py:NAME (or "
            "start from netpart's seeded weights, --init seed)"
        )
    return importer.module_weights(model, spec, seed=config.run.seed)


def _resumed(request: TrainRequest) -> Job:
    """The job of the run directory `request.resume`, with the flags given over its config."""
    run = request.resume
    if request.out is not None and request.out.resolve() != run.resolve():
        raise TrainError(
            f"--out {request.out}: a resume continues in its own run directory ({run}); drop "
            "--out (to continue a copy, copy the directory first and resume the copy)"
        )
    old = read_job(run, resume=True)
    if not any(run.glob("shard_*.pt")):
        raise TrainError(
            f"--resume {run}: the run has no checkpoint (its job ended before the first); "
            f"start it again without --resume, with --out {run} (the directory is reused)"
        )
    if old.config.cluster.mode == "sandblaster":
        raise TrainError(
            f"--resume {run}: a Sandblaster L-BFGS run cannot be resumed (its curvature "
            "history and iteration count are not checkpointed); start a new --out"
        )
    if (
        request.model is not None
        and load_spec(request.model, input=request.input).fingerprint() != old.spec.fingerprint()
    ):
        raise TrainError(f"--resume {run}: the run trained {old.spec.name}, not {request.model}")
    if request.workers is not None and request.workers != old.plan.workers:
        raise TrainError(
            f"--workers {request.workers}: the run in {run} has {old.plan.workers} workers per "
            "replica; resume with the same layout or start a new --out"
        )
    for name in FIXED_ON_RESUME:
        given = request.given.get(name)
        if given is not None and given != old.config.get(name):
            raise TrainError(
                f"{flag(name)} {given}: the run in {run} has {old.config.get(name)}; "
                "resume with the same value or start a new --out"
            )
    config = old.config.with_flat(**request.given)
    check_loggers(config.loggers)
    reached = min(read_progress(run, old.config.cluster).values())
    if config.run.steps <= reached:
        raise TrainError(
            f"--steps {config.run.steps}: the run in {run} is at step {reached} already; give "
            f"--steps above {reached} to train it further"
        )
    return Job(old.spec, old.plan, config, run, resume=True)


def banner(job: Job) -> str:
    """One line: what is about to run, and where."""
    cluster, opt = job.config.cluster, job.config.optimiser
    processes, cores = job.config.world(job.plan.workers), os.cpu_count() or 1
    shared = f" on {cores} cores" if processes > cores else ""
    return (
        f"{job.spec.name}: {cluster.replicas} replica(s) x {job.plan.workers} worker(s) + "
        f"{cluster.shards} shard(s) = {processes} processes{shared}, {cluster.mode}, "
        f"{opt.name} lr {opt.lr}; run directory {job.run}"
    )


def under_torchrun() -> bool:
    """Whether this process is one of a torchrun job's."""
    return os.environ.get("RANK") is not None and bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def train_here(
    request: TrainRequest,
    on_start: Callable[[str], None] | None = None,
    on_progress: Callable[[int, dict, int], None] | None = None,
) -> tuple[Job, TrainSummary]:
    """Run the requested job on this machine: every process through the one launcher, forked
    by an interpreter that imports torch while this one applies the rules and plans.
    `on_start(banner)` once the job is validated and its processes start; `on_progress` as
    `netpart.train.launch.train` calls it."""
    from netpart.planning.memory import check_fits
    from netpart.processes.zygote import Preloaded
    from netpart.train.launch import train

    # imports torch while this process plans; kept for the next job (a restart, or the
    # next job of a process that runs several)
    preloaded = Preloaded.kept("netpart.train.process", new_session=True)
    job = make_job(request)
    if job.run.exists() and not job.run.is_dir():
        raise TrainError(f"--out {job.run}: exists and is not a directory")
    # before any process or any file
    job_memory = job.config.memory_job(job.plan.workers)
    check_fits(job.spec, job.plan, available=available_memory(), **job_memory)
    started = False

    def progress(done: int, stats: dict, total: int) -> None:
        nonlocal started
        if not started and on_start is not None:
            on_start(banner(job))
        started = True
        if on_progress is not None:
            on_progress(done, stats, total)

    with RunLock(job.run):  # one job in a run directory at a time
        summary = train(
            job.spec,
            job.plan,
            job.config,
            job.run,
            job.resume,
            on_progress=progress,
            preloaded=preloaded,
            initial=job.initial,
        )
    return job, summary


def train_torchrun(request: TrainRequest, echo: Callable[[str], None]) -> int:
    """Play this torchrun process's part of the requested job; its exit code."""
    from netpart.train.launch import train_under_torchrun

    job = make_job(request, local=False)
    return train_under_torchrun(
        job.spec, job.plan, job.config, job.run, job.resume, echo, initial=job.initial
    )
