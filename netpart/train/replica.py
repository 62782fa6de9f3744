"""A model worker of a replica in Downpour or synchronous SGD: the replica's step loop.

The worker fetches the shards' parameters, runs lockstep steps with its replica, pushes its
accumulated gradients every `n_push` steps (sooner with `push_norm`) and queues a fetch every
`n_fetch` steps (Downpour); between steps, when no autograd graph holds them, its parameters
become views of the fetched values where they landed (no copy). Backward accumulates
straight into the buffer a push sends. In sync mode it pushes every step and waits for the
fetch.
Worker 0 of each replica writes the replica's metrics, one line per step.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from netpart import faults
from netpart.data import load_data
from netpart.errors import RuntimeFailure
from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.partition.schedule import HaloSchedule
from netpart.partition.shards import ShardLayout
from netpart.ps.client import ShardClient, Ticket
from netpart.runtime.transport import GlooTransport
from netpart.runtime.worker import ModelWorker
from netpart.train.config import TrainConfig
from netpart.train.placement import Placement

__all__ = [
    "DTYPES",
    "FLUSH_S",
    "IN_FLIGHT",
    "GradBuffers",
    "ReplicaJob",
    "push_due",
    "run_worker",
]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
FLUSH_S = 0.2  # seconds between appends of the metrics lines
IN_FLIGHT = 2  # Downpour requests a worker keeps in flight (each holds a gradient buffer)


@dataclass(frozen=True)
class ReplicaJob:
    """What one model worker of one replica needs to train."""

    spec: ModelSpec
    graph: UnitGraph
    schedule: HaloSchedule
    layout: ShardLayout
    config: TrainConfig
    replica: int
    worker: int
    rank: int
    group: dist.ProcessGroup
    placement: Placement
    run: Path
    start: int = 0

    def build(self) -> tuple[ModelWorker, GlooTransport, ShardClient]:
        """The worker's model slices, its transport and its client."""
        dtype = DTYPES[self.config.dtype]
        model = ModelWorker(
            self.spec, self.graph, self.schedule, self.worker, self.config.seed, dtype
        )
        tensors = model.param_tensors()
        if sum(t.numel() for t in tensors) != self.layout.worker_size(self.worker):
            raise RuntimeError(f"worker {self.worker}: slices and shard layout disagree on sizes")
        transport = GlooTransport(self.group, ranks=self.placement.replica_ranks(self.replica))
        shard_ranks = [self.placement.shard_rank(s) for s in range(self.config.shards)]
        background = self.config.mode == "downpour"  # nobody waits for a Downpour push
        client = ShardClient(
            self.layout, self.worker, self.replica, self.rank, shard_ranks, dtype,
            IN_FLIGHT + 1, background,
        )  # fmt: skip
        return model, transport, client


def run_worker(
    job: ReplicaJob, stop: threading.Event, on_step: Callable[[dict], None] | None = None
) -> None:
    """Train until `config.steps` (or a stop agreed by the replica); then push what is left
    and say goodbye to the shards.

    Downpour keeps up to `IN_FLIGHT` requests in flight: fetched values are used from the
    first step that starts after they arrived, and a step waits for the shards only when the
    oldest request is still out as a new one is due (its buffers are needed again). Sync
    completes each request at once.
    """
    config, replica = job.config, job.replica
    model, transport, client = job.build()
    faults.point(job.rank, 0)
    load = model.bind_values
    data = load_data(config.data, job.spec, config.seed, config.examples)
    sync = config.mode == "sync"
    warm = config.warm_start if (replica > 0 and not sync and job.start < config.warm_start) else 0
    if warm:
        log.info("waiting for replica 0's %d warm-start steps", warm)
    load(client.complete(client.request(job.start, fetch=True, fetch_step=warm)))
    grads = GradBuffers(model, client.push_buffers(1 if sync else IN_FLIGHT + 1))
    inflight: collections.deque[Ticket] = collections.deque()
    metrics = _Metrics(job) if job.worker == 0 else None
    unpushed, t = 0, job.start
    clock = time.perf_counter
    try:
        for t in range(job.start + 1, config.steps + 1):
            faults.point(job.rank, t)
            t0 = clock()
            _complete_oldest(client, inflight, load, IN_FLIGHT)  # only what has arrived
            t1 = clock()
            x, y = data.batch(replica, config.replicas, t, config.batch, DTYPES[config.dtype])
            t2 = clock()
            # A signal reaches a replica's workers at different moments: the flag travels with
            # the loss's collective, so they all stop after the same step.
            result = model.step(
                x, y, transport, collect_grads=False, stop=stop.is_set(), accuracy=job.worker == 0
            )
            t3 = clock()
            if not math.isfinite(result.loss):  # never push it: it would poison every replica
                raise RuntimeFailure(
                    f"replica {replica}: the loss is {result.loss} at step {t}: training "
                    "diverged; try a lower --lr"
                )
            unpushed += 1
            pushed = sync or push_due(t, config.n_push, config.push_norm, grads.flat)
            fetched = sync or t % config.n_fetch == 0
            if pushed or fetched:
                _complete_oldest(client, inflight, load, IN_FLIGHT - 1)
                ticket = client.request(t, grads.flat if pushed else None, fetched)
                if sync:
                    load(client.complete(ticket))
                else:
                    inflight.append(ticket)
                if pushed:
                    grads.advance()
                    unpushed = 0
            t4 = clock()
            if metrics is not None:
                times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                line = metrics.line(t, result, client.staleness, times, pushed, fetched)
                if on_step is not None:
                    on_step(line)
            if result.stop:
                log.info("stopping after step %d", t)
                break
        if unpushed:
            client.request(t, grads.flat)
        client.close()
    finally:
        if metrics is not None:
            metrics.close()


def _complete_oldest(client: ShardClient, inflight: collections.deque, load, keep: int) -> None:
    """Complete the requests in flight, oldest first, that have arrived, and more (waiting)
    until at most `keep` are left; the parameters become views of the newest values."""
    while inflight and (len(inflight) > keep or client.arrived(inflight[0])):
        fresh = client.complete(inflight.popleft())
        if fresh is not None:
            load(fresh)


class _Metrics:
    """Worker 0's per-step metrics lines (`metrics_replica<r>.jsonl`)."""

    def __init__(self, job: ReplicaJob) -> None:
        self.replica, self.config = job.replica, job.config
        size = torch.empty(0, dtype=DTYPES[job.config.dtype]).element_size()
        halo_values = sum(len(u) for layer in job.schedule.sends for u in layer.values())
        self.size = size
        self.halo_bytes = 2 * halo_values * job.config.batch * size  # fwd + bwd, all workers
        self.ps_values = sum(job.layout.worker_size(w) for w in range(job.layout.workers))
        path = job.run / f"metrics_replica{job.replica}.jsonl"
        # Lines are appended in one write call every FLUSH_S seconds (and at the end): a line
        # is on disk within FLUSH_S of its step. A write per line cost 3-5% of a small
        # model's samples/s, and a writer thread more (it contends for the GIL).
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    def line(self, step, result, staleness, times, pushed, fetched) -> dict:
        take_s, data_s, step_s, ps_s = times
        halo_s = sum(result.exchange_s.values())  # exposed: posting, waiting, the loss
        line = {
            "step": step,
            "replica": self.replica,
            "time": time.time(),
            "loss": result.loss,
            "accuracy": result.accuracy,
            "staleness": staleness if staleness >= 0 else None,
            "samples": self.config.batch,
            "step_s": sum(times),
            "compute_s": step_s - halo_s,
            "halo_s": halo_s,
            "ps_s": take_s + ps_s,
            "data_s": data_s,
            "halo_bytes": self.halo_bytes,
            "ps_bytes": (int(pushed) + int(fetched)) * self.ps_values * self.size,
        }
        self._lines.append(json.dumps(line) + "\n")
        if time.monotonic() - self._flushed >= FLUSH_S:
            self._flush()
        return line

    def _flush(self) -> None:
        if self._lines:
            os.write(self.fd, "".join(self._lines).encode())
            self._lines = []
        self._flushed = time.monotonic()

    def close(self) -> None:
        """Write what is left; close the file."""
        try:
            self._flush()
        finally:
            os.close(self.fd)


def push_due(step: int, n_push: int, push_norm: float, grads: torch.Tensor) -> bool:
    """Downpour: push every `n_push` steps, and sooner once the accumulated gradient's L2
    norm reaches `push_norm` (when > 0): small gradients wait, large ones go at once."""
    if step % n_push == 0:
        return True
    if push_norm <= 0:
        return False
    return float(grads.square().sum()) >= push_norm * push_norm


class GradBuffers:
    """Flat gradient buffers in the worker's piece order (zeroed; `ShardClient.push_buffers`),
    used in turn; every parameter's `.grad` is a view of the current one, so backward
    accumulates straight into what a push sends (no gather, no allocation per step).
    `advance` moves to the next buffer and zeroes it: the caller guarantees its last push has
    completed (with k buffers, it was posted k pushes ago). `model` binds the views
    (`ModelWorker.bind_grads`, or any object with that method)."""

    def __init__(self, model, buffers: list[torch.Tensor]) -> None:
        self.model = model
        self.buffers = buffers
        self.current = 0
        self._bind()

    @property
    def flat(self) -> torch.Tensor:
        return self.buffers[self.current]

    def advance(self) -> None:
        """The current buffer was pushed: move to the next one, zeroed."""
        self.current = (self.current + 1) % len(self.buffers)
        self.flat.zero_()
        self._bind()

    def _bind(self) -> None:
        self.model.bind_grads(self.flat)
