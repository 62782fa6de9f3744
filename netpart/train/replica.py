"""A model worker of a replica in Downpour or synchronous SGD: the replica's step loop.

The worker fetches the shards' parameters, runs lockstep steps with its replica, pushes its
accumulated gradients every `n_push` steps (sooner with `push_norm`) and queues a fetch every
`n_fetch` steps (Downpour); between steps, when no autograd graph holds them, its parameters
become views of the fetched values where they landed (no copy). Backward accumulates
straight into the buffer a push sends. In sync mode it pushes every step and waits for the
fetch.
Worker 0 of each replica writes the replica's metrics, one line per step; with
`--eval-every`, replica 0 also evaluates on held-out data (`netpart.train.heldout`).
"""

from __future__ import annotations

import collections
import contextlib
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
from netpart.compile.schedule import HaloSchedule
from netpart.compile.shards import ShardLayout
from netpart.errors import RuntimeFailure
from netpart.files import open_append
from netpart.models.dropout import training_key
from netpart.models.reference import DTYPES
from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.ps.checkpoint import read_statistics, save_statistics
from netpart.ps.client import ShardClient, Ticket
from netpart.runtime.batchnorm import batches_tracked, collect_statistics, load_statistics
from netpart.runtime.transport import GlooTransport
from netpart.runtime.worker import ModelWorker
from netpart.train.config import TrainConfig
from netpart.train.heldout import HeldOut
from netpart.train.placement import Placement

__all__ = [
    "FLUSH_S",
    "IN_FLIGHT",
    "GradBuffers",
    "ReplicaJob",
    "Requests",
    "push_due",
    "run_worker",
]

log = logging.getLogger(__name__)

FLUSH_S = 0.2  # seconds between appends of the metrics lines
IN_FLIGHT = 2  # Downpour requests a worker keeps in flight (each holds a gradient buffer)
LOSS_BLOWUP = 1e6  # a loss this many times the job's first (or 1) has diverged


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
        dtype = DTYPES[self.config.run.dtype]
        model = ModelWorker(
            self.spec,
            self.graph,
            self.schedule,
            self.worker,
            seed=self.config.run.seed,
            dtype=dtype,
        )
        tensors = model.param_tensors()
        if sum(t.numel() for t in tensors) != self.layout.worker_size(self.worker):
            raise RuntimeError(f"worker {self.worker}: slices and shard layout disagree on sizes")
        transport = GlooTransport(self.group, ranks=self.placement.replica_ranks(self.replica))
        shard_ranks = [self.placement.shard_rank(s) for s in range(self.config.cluster.shards)]
        # Downpour never waits for a push; a courier posts requests and flags fetched values
        # the moment they arrive. With local steps the parameters already hold this worker's
        # updates, so a fetch can wait to be completed until its slot is needed (two steps
        # on): requests are posted from the step loop, and no courier threads compete with it
        # for the GIL and the cores.
        background = self.config.cluster.mode == "downpour" and not self.config.local_steps
        client = ShardClient(
            self.layout,
            worker=self.worker,
            replica=self.replica,
            rank=self.rank,
            shard_ranks=shard_ranks,
            dtype=dtype,
            depth=IN_FLIGHT + 1,
            background=background,
            local_steps=self.config.local_steps,
        )
        return model, transport, client


def run_worker(
    job: ReplicaJob, stop: threading.Event, on_step: Callable[[dict], None] | None = None
) -> None:
    """Train until `config.run.steps` (or a stop agreed by the replica); then push what is left
    and say goodbye to the shards.

    Downpour keeps up to `IN_FLIGHT` requests in flight: fetched values are used from the
    first step that starts after they arrived, and a step waits for the shards only when the
    oldest request is still out as a new one is due (its buffers are needed again). Sync
    completes each request at once. With local steps (`TrainConfig.local_steps`) every step
    is also applied to the worker's own parameters (`Requests`).
    """
    loop = _StepLoop(job, on_step)
    t = job.start
    try:
        for t in range(job.start + 1, job.config.run.steps + 1):
            faults.point(job.rank, t)
            if loop.step(t, stop=stop.is_set()):
                log.info("stopping after step %d", t)
                break
        loop.finish(t)
    finally:
        loop.close()


class _StepLoop:
    """One worker's training state: its model slices, transport, client, data, gradient
    buffers, requests in flight and (worker 0) the replica's metrics."""

    def __init__(self, job: ReplicaJob, on_step: Callable[[dict], None] | None) -> None:
        config, replica = job.config, job.replica
        self.job, self.on_step = job, on_step
        self.model, self.transport, self.client = job.build()
        faults.point(job.rank, 0)
        self.data = config.dataset(job.spec)
        self.sync = config.cluster.mode == "sync"
        late = replica > 0 and not self.sync and job.start < config.optimiser.warm_start
        warm = config.optimiser.warm_start if late else 0
        if warm:
            log.info("waiting for replica 0's %d warm-start steps", warm)
        client = self.client
        first = client.complete(client.request(job.start, fetch=True, fetch_step=warm))
        self.model.bind_values(first)
        local = config.local_steps
        buffers = client.push_buffers(1 if self.sync else IN_FLIGHT + 1)
        # Local steps between pushes apply each step's own gradient: backward writes it apart.
        apart = local and (config.optimiser.n_push > 1 or config.optimiser.push_norm > 0)
        scratch = torch.zeros_like(buffers[0]) if apart else None
        self.grads = GradBuffers(self.model, buffers, scratch)
        self.requests = Requests(
            client, self.model, self.grads, config.optimiser.lr if local else None, first
        )
        self.metrics = _Metrics(job) if job.worker == 0 else None
        self.first_loss = 0.0  # this job's first step's: a loss far above it has diverged
        # Replica 0's batch norms' running statistics are the model's (`train.rundir`).
        norms = any(layer.kind == "batchnorm" for layer in job.spec.layers)
        self.keeps_statistics = replica == 0 and norms
        if self.keeps_statistics and job.start > 0:
            kept, at = read_statistics(job.run, job.spec, job.layout.workers)
            if at is not None and at != job.start:
                log.warning("running statistics from step %d, resuming at %d", at, job.start)
            load_statistics(self.model.slices, kept)
        self.held_out = None
        if replica == 0 and config.run.eval_every > 0:
            path = job.run / "eval.jsonl" if job.worker == 0 else None
            self.held_out = HeldOut(
                job.spec, self.data, config.data.batch, DTYPES[config.run.dtype], path
            )

    def step(self, t: int, stop: bool) -> bool:
        """Step `t`: settle what arrived, compute on the batch, push and fetch as due; True
        when the replica agreed to stop after it."""
        job, config, clock = self.job, self.job.config, time.perf_counter
        t0 = clock()
        self.requests.settle(IN_FLIGHT)  # only what has arrived
        t1 = clock()
        x, y = self.data.batch(
            job.replica, config.cluster.replicas, t, config.data.batch, DTYPES[config.run.dtype]
        )
        t2 = clock()
        # A signal reaches a replica's workers at different moments: the flag travels with
        # the loss's collective, so they all stop after the same step.
        result = self.model.step(
            x,
            y,
            self.transport,
            collect_grads=False,
            stop=stop,
            accuracy=job.worker == 0,
            dropout=training_key(job.spec, config.run.seed, t, job.replica * config.data.batch),
        )
        t3 = clock()
        self.first_loss = self.first_loss or result.loss
        blown = result.loss > LOSS_BLOWUP * max(self.first_loss, 1.0)
        if not math.isfinite(result.loss) or blown:  # never push it: it would poison all
            with contextlib.suppress(Exception):  # the shards keep a checkpoint from before
                self.client.close(diverged_at=t)
            first = f" (its first was {self.first_loss:.4g})" if blown else ""
            raise RuntimeFailure(
                f"replica {job.replica}: the loss is {result.loss:.4g} at step {t}{first}: "
                "training diverged"
            )
        self.requests.stepped()
        pushed = self.sync or push_due(
            t, config.optimiser.n_push, config.optimiser.push_norm, self.grads.flat
        )
        fetched = self.sync or t % config.optimiser.n_fetch == 0
        if pushed or fetched:
            self.requests.post(t, pushed, fetched, wait=self.sync)
        t4 = clock()
        if self.metrics is not None:
            times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            client = self.client
            line = self.metrics.line(t, result, client.staleness, times, pushed, client.received)
            if self.on_step is not None:
                self.on_step(line)
        if self.keeps_statistics and t % config.run.checkpoint_every == 0:
            self.save_statistics(t)
        if self.held_out is not None and (
            t % config.run.eval_every == 0 or t == config.run.steps or result.stop
        ):
            self.held_out(t, self.model, self.transport)
        return result.stop

    def save_statistics(self, t: int) -> None:
        """Write this worker's running statistics after step `t` (replica 0)."""
        slices = self.model.slices
        tracked = batches_tracked(slices)
        save_statistics(self.job.run, self.job.worker, t, collect_statistics(slices), tracked)

    def finish(self, t: int) -> None:
        """Push what is left after step `t`, and say goodbye to the shards."""
        if self.keeps_statistics:
            self.save_statistics(t)
        if self.requests.unpushed:
            self.client.request(t, self.grads.flat, ahead=self.requests.ahead)
        self.client.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


class Requests:
    """A worker's requests to the shards in flight, oldest first, each with the gradient
    buffer it pushed; the parameters are views of the newest values fetched.

    With a learning rate (local steps: Downpour's client in Dean et al. 2012, whose replica
    applies p -= lr * g to its own parameters every step) the newest values are brought up to
    date when they arrive: fetched values reflect this worker's pushes up to their request,
    so its later pushes, still in flight, and its unpushed steps are applied to them as the
    shards' SGD will. With one replica every step's parameters are then single-process SGD's.
    Where nothing but this worker's pushes changed the shards' values, they answer CURRENT and
    send none: the values held already are those (one replica's fetches move no values).
    """

    def __init__(
        self, client: ShardClient, model, grads: GradBuffers, lr: float | None, values
    ) -> None:
        """`values`: what the model's parameters are views of now (`bind_values`)."""
        self.client, self.model, self.grads, self.lr = client, model, grads, lr
        self.inflight: collections.deque[tuple[Ticket, torch.Tensor | None]] = collections.deque()
        self.values: torch.Tensor = values
        self.unpushed = 0  # steps since the last push
        self.ahead = 0  # this worker's pushes applied locally that the values fetched lack

    def settle(self, keep: int) -> None:
        """Complete the requests in flight, oldest first, that have arrived, and more
        (waiting) until at most `keep` are left; the parameters become the newest values."""
        inflight, client = self.inflight, self.client
        while inflight and (len(inflight) > keep or client.arrived(inflight[0][0])):
            ticket = inflight.popleft()[0]
            fresh = client.complete(ticket)
            if self.lr is None:
                if fresh is not None:
                    self.model.bind_values(fresh)
                continue
            if ticket.dropped or not ticket.fetch:
                continue
            later = [pushed for _, pushed in inflight if pushed is not None]
            self.ahead = len(later)
            if fresh is None:  # every shard answered CURRENT: its values are these already
                continue
            self.model.bind_values(fresh)
            for pushed in later:  # in the order the shards will apply them
                fresh.add_(pushed, alpha=-self.lr)
            if self.unpushed:
                fresh.add_(self.grads.flat, alpha=-self.lr)
            for lo, hi in client.current_ranges(ticket):  # the values here are those already
                fresh[lo:hi] = self.values[lo:hi]
            self.values = fresh

    def stepped(self) -> None:
        """A step's gradient is in: apply it locally (with a learning rate) and count it."""
        if self.lr is not None:
            self.values.add_(self.grads.step, alpha=-self.lr)
        self.grads.fold()
        self.unpushed += 1

    def post(self, step: int, push: bool, fetch: bool, wait: bool) -> None:
        """Push the accumulated gradients and/or fetch; `wait` (sync) completes it at once."""
        self.settle(IN_FLIGHT - 1)
        flat = self.grads.flat if push else None
        ticket = self.client.request(step, flat, fetch, ahead=self.ahead)
        if wait:
            fresh = self.client.complete(ticket)
            if fresh is not None:
                self.model.bind_values(fresh)
        else:
            self.inflight.append((ticket, flat))
        if push:
            self.grads.advance()
            self.unpushed = 0
            self.ahead += self.lr is not None


class _Metrics:
    """Worker 0's per-step metrics lines (`metrics_replica<r>.jsonl`)."""

    def __init__(self, job: ReplicaJob) -> None:
        self.replica, self.config = job.replica, job.config
        size = torch.empty(0, dtype=DTYPES[job.config.run.dtype]).element_size()
        halo_values = sum(len(u) for layer in job.schedule.sends for u in layer.values())
        self.size = size
        self.halo_bytes = 2 * halo_values * job.config.data.batch * size  # fwd + bwd, all workers
        self.ps_values = sum(job.layout.worker_size(w) for w in range(job.layout.workers))
        self.scale = self.ps_values / max(1, job.layout.worker_size(job.worker))
        self.received = 0  # the client's count of values received at the last line
        path = job.run / f"metrics_replica{job.replica}.jsonl"
        # Lines are appended in one write call every FLUSH_S seconds (and at the end): a line
        # is on disk within FLUSH_S of its step. A write per line slows a small model's
        # step loop, and a writer thread more (it contends for the GIL; docs/training.md).
        self.fd = open_append(path, lines=True)
        self._lines: list[str] = []
        self._flushed = time.monotonic()
        self._cpu = time.process_time()

    def line(self, step, result, staleness, times, pushed, received) -> dict:
        """A step's metrics line; `received`: the client's count of values fetched so far
        (the replica's fetched bytes are this worker's, scaled to all its workers)."""
        take_s, data_s, step_s, ps_s = times
        fetched, self.received = (received - self.received) * self.scale, received
        cpu, self._cpu = self._cpu, time.process_time()  # the process's, every thread's
        halo_s = sum(result.exchange_s.values())  # exposed: posting, waiting, the loss
        line = {
            "step": step,
            "replica": self.replica,
            "time": time.time(),
            "loss": result.loss,
            "accuracy": result.accuracy,
            "staleness": staleness if staleness >= 0 else None,
            "samples": self.config.data.batch,
            "step_s": sum(times),
            "compute_s": step_s - halo_s,
            "halo_s": halo_s,
            "ps_s": take_s + ps_s,
            "data_s": data_s,
            "cpu_s": self._cpu - cpu,
            "halo_bytes": self.halo_bytes,
            "ps_bytes": round(int(pushed) * self.ps_values + fetched) * self.size,
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
    (`ModelWorker.bind_grads`, or any object with that method). With a `scratch` buffer,
    backward writes each step's gradient there instead (`step`), and `fold` adds it to the
    current buffer (local steps apply one step's gradient where several make a push)."""

    def __init__(
        self, model, buffers: list[torch.Tensor], scratch: torch.Tensor | None = None
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.scratch = scratch
        self.current = 0
        self._bind()

    @property
    def flat(self) -> torch.Tensor:
        """The gradients accumulated since the last push."""
        return self.buffers[self.current]

    @property
    def step(self) -> torch.Tensor:
        """The last step's gradient (before `fold`)."""
        return self.flat if self.scratch is None else self.scratch

    def fold(self) -> None:
        """After a step: its gradient joins the current buffer (zeroed in the scratch)."""
        if self.scratch is not None:
            self.flat.add_(self.scratch)
            self.scratch.zero_()

    def advance(self) -> None:
        """The current buffer was pushed: move to the next one, zeroed."""
        self.current = (self.current + 1) % len(self.buffers)
        self.flat.zero_()
        self._bind()

    def _bind(self) -> None:
        self.model.bind_grads(self.step)
