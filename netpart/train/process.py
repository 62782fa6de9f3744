"""One process of a training job: a model worker of some replica, a parameter-server shard, or
Sandblaster's coordinator. `python -m netpart.train.process --run DIR [--resume]`.

Started by the launcher (`netpart.processes.launcher`) or by torchrun (through `netpart train`,
which calls `play_role` itself). The process reads the run directory (spec, plan, config,
start steps), joins the default gloo group, learns its role from the placement and plays it.
Every rank creates every replica's process group in the same order (torch.distributed requires
it); halo exchanges of replica r use its group, parameter-server messages the default group.

SIGTERM or SIGINT ends training at the next step boundary: workers push what they hold and
say goodbye, shards write a final checkpoint. Any error ends the process with code 1 and one
line naming its role.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from netpart import faults
from netpart.compile.compiled import CompiledPlan, compile_plan
from netpart.compile.schedule import NO_SPLITS, SPLIT_MIN_FLOPS
from netpart.files import write_atomic
from netpart.processes.groups import new_groups, wait_bounded
from netpart.processes.launcher import join_group, mark_started, yield_io_threads
from netpart.ps.server import ShardServer
from netpart.train.config import TrainConfig
from netpart.train.placement import COORDINATOR, WORKER, Placement, place
from netpart.train.replica import ReplicaJob, run_worker
from netpart.train.rundir import Job, read_job
from netpart.train.sandblaster import run_coordinator, run_unit_worker
from netpart.train.shard import serve_shard

__all__ = [
    "PS_TIMEOUT",
    "compute_setup",
    "job_placement",
    "log_as",
    "play_role",
    "split_min_flops",
    "stop_on_signals",
]

log = logging.getLogger(__name__)

PS_TIMEOUT = 24 * 3600.0  # parameter-server pairs idle for long; deaths are seen at once
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM, SIGINT or SIGHUP (the process then finishes its step and
    exits)."""
    stop = threading.Event()

    def handler(signum, frame):
        logging.getLogger("netpart.train").info("signal %d: stopping after this step", signum)
        stop.set()

    for sig in STOPS:
        signal.signal(sig, handler)
    return stop


def log_as(who: str) -> None:
    """Prefix this process's log lines with its role and rank: '[replica 1 worker 0 (rank 2)]'."""
    logging.basicConfig(
        level=logging.INFO, format=f"[{who}] %(message)s", stream=sys.stderr, force=True
    )


def job_placement(config: TrainConfig, workers: int, node: str | None = None) -> Placement:
    """The placement of this job: the node id of every rank (torchrun's GROUP_RANK; 0 when
    spawned locally) is gathered over the default group as a number, then placed by
    `config.cluster.placement`.

    The gather is the group's first exchange and waits at most twice the start-up deadline
    (the default group's own timeout is a day, for the shards): a connection that is not the
    job's can take a peer's place in gloo's rendezvous, and the job must not wait for ever.
    """
    world = config.world(workers)
    mine = int(node if node is not None else os.environ.get("GROUP_RANK", "0"))
    nodes = torch.zeros(world, dtype=torch.int64)
    gather = dist.all_gather(
        list(nodes.unbind(0)), torch.tensor(mine, dtype=torch.int64), async_op=True
    )
    why = "a process is stuck or a connection that is not the job's reached its listeners"
    wait_bounded(gather, 2 * config.start_timeout, "the job's start-up exchange", why)
    hosts = [f"node{k}" for k in nodes.tolist()]
    return place(
        hosts,
        config.cluster.replicas,
        workers,
        config.cluster.shards,
        config.cluster.placement,
        config.coordinators,
    )


def compute_setup(threads: int) -> None:
    """This process's torch threads, and subnormal floats flushed to zero, as TensorFlow's CPU
    kernels do (threads made from here on inherit it): near a loss of zero a model's
    gradients go subnormal, and x86 multiplies those many times slower (docs/training.md,
    "Subnormal numbers")."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def split_min_flops(placement: Placement, rank: int) -> float:
    """What a layer's work must reach to be split on `rank`: a replica whose workers share a
    host exchanges halos as memory copies on the cores that compute, so splitting layers to
    hide them costs what it saves; across hosts it pays."""
    role = placement.roles[rank]
    across = role.kind == WORKER and len(placement.hosts_of_replica(role.replica)) > 1
    return SPLIT_MIN_FLOPS if across else NO_SPLITS


def play_role(
    job: Job,
    compiled: CompiledPlan,
    rank: int,
    stop: threading.Event,
    placement: Placement,
    on_step: Callable[[dict], None] | None = None,
) -> ShardServer | None:
    """The role of `rank` in the job, with the plan compiled for it (`split_min_flops`). A shard
    returns its server once every shard has written its final checkpoint (None if one
    failed); other roles return None.

    `on_step(line)` is called with every metrics line this process writes (worker 0 of each
    replica writes them), for a progress bar.
    """
    spec, config = job.spec, job.config
    halo_timeout = datetime.timedelta(seconds=config.cluster.timeout)
    shard_ranks = [placement.shard_rank(s) for s in range(config.cluster.shards)]
    members = [placement.replica_ranks(r) for r in range(config.cluster.replicas)] + [shard_ranks]
    *groups, shard_group = new_groups(members, timeout=halo_timeout)  # checked before use
    role = placement.roles[rank]
    yield_io_threads()  # the new groups' I/O threads
    graph, schedule, layout = compiled.graph, compiled.schedule, compiled.layout
    if role.kind == COORDINATOR:
        stats = run_coordinator(config, placement, rank, job.run, stop)
        write_atomic(job.run / "coordinator.json", json.dumps(stats, indent=1).encode())
        return None
    if role.kind == WORKER:
        r = role.replica
        replica = ReplicaJob(
            spec=spec,
            graph=graph,
            schedule=schedule,
            layout=layout,
            config=config,
            replica=r,
            worker=role.worker,
            rank=rank,
            group=groups[r],
            placement=placement,
            run=job.run,
            start=dict(job.starts).get(r, 0),
        )
        if config.cluster.mode == "sandblaster":
            run_unit_worker(replica)
        else:
            run_worker(replica, stop, on_step)
        return None
    server = serve_shard(job, layout, role.shard, rank, stop, placement)
    try:  # after this, every shard's final checkpoint is on disk
        dist.barrier(group=shard_group)
    except RuntimeError as exc:
        log.warning("not every shard finished: %s", exc)
        return None
    return server


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m netpart.train.process")
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    log_as(f"rank {rank}")
    for sig in STOPS:  # while starting, a stop ends the process at once: nothing to save yet
        signal.signal(sig, signal.SIG_DFL)
    try:
        job = read_job(args.run, args.resume)
        compute_setup(job.config.cluster.threads)
        faults.point(rank, -1)
        # the launcher holds start-up to its deadline until the placement is known
        join_group(PS_TIMEOUT, started=False)
        faults.point(rank, -2)
        placement = job_placement(job.config, job.plan.workers)
        mark_started()
        stop = stop_on_signals()  # from here a stop is graceful: the step ends, shards write
        log_as(f"{placement.name(rank)} (rank {rank})")
        # the launcher validated the plan
        compiled = compile_plan(
            job.spec,
            job.plan,
            shards=job.config.cluster.shards,
            validate=False,
            split_min_flops=split_min_flops(placement, rank),
        )
        play_role(job, compiled, rank, stop, placement)
    except Exception as exc:  # one line for the launcher, which reports the last error line
        logging.getLogger("netpart.train").error("error: %s", exc)
        sys.stderr.flush()
        os._exit(1)  # peers in other threads may still block in gloo: do not wait for them
    sys.stderr.flush()
    os._exit(0)  # same: a lost replica's connections must not hold up a finished process


if __name__ == "__main__":
    raise SystemExit(main())
