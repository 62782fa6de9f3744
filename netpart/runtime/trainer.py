"""One process of a training job: a model worker of some replica, or a parameter-server shard.

`run_process` is called with the default process group initialised (by the local launcher's
`train_main`, or by torchrun through `netpart train`). Every rank creates every replica's
process group in the same order (torch.distributed requires it); halo exchanges of replica r
use its group, parameter-server messages the default group.

A worker trains its slices: it fetches the shards' parameters, runs lockstep steps with its
replica, pushes its accumulated gradients every `n_push` steps and queues a fetch every
`n_fetch` steps (downpour); fetched values are copied into its parameters between steps, when
no autograd graph holds them. In sync mode it pushes every step and waits for the fetch.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.data import load_data
from netpart.files import write_atomic
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.partition.shards import ShardLayout, piece_initial
from netpart.runtime.checkpoint import checkpoint_meta, load_shard, save_shard
from netpart.runtime.config import TrainConfig
from netpart.runtime.placement import Placement, place
from netpart.runtime.ps import ShardServer, ShardState
from netpart.runtime.ps_client import ShardClient
from netpart.runtime.sandblaster import run_coordinator
from netpart.runtime.sandblaster import run_worker as run_sandblaster_worker
from netpart.runtime.schedule import plan_schedule
from netpart.runtime.transport import GlooTransport, _gloo_reason
from netpart.runtime.updates import UpdateRule
from netpart.runtime.worker import ModelWorker

__all__ = ["initial_values", "job_placement", "run_process"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
PS_TIMEOUT = datetime.timedelta(
    days=1
)  # parameter-server pairs idle for long; deaths are seen at once


def initial_values(
    spec: ModelSpec, layout: ShardLayout, shard: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Shard `shard`'s initial values: the reference initialisation of the pieces it holds."""
    lo, hi = int(layout.bounds[shard]), int(layout.bounds[shard + 1])
    out = torch.zeros(hi - lo, dtype=dtype)
    done: set[int] = set()
    for w in range(layout.workers):  # loops over pieces (tens per worker), not values
        for piece, off in zip(layout.pieces[w], layout.offsets[w].tolist(), strict=True):
            a, b = max(off, lo), min(off + piece.size, hi)
            if a >= b or off in done or piece.param == "bias":
                continue
            done.add(off)
            values = torch.from_numpy(piece_initial(spec, seed, piece))
            out[a - lo : b - lo] = values[a - off : b - off].to(dtype)
    return out


def job_placement(config: TrainConfig, workers: int, node: str | None = None) -> Placement:
    """The placement of this job: the node id of every rank is gathered over the default group
    (torchrun's GROUP_RANK; one node when spawned locally), then placed by `config.placement`."""
    world = config.world(workers)
    node = node if node is not None else os.environ.get("GROUP_RANK", "0")
    hosts: list = [None] * world
    dist.all_gather_object(hosts, f"node{node}")
    return place(
        hosts, config.replicas, workers, config.shards, config.placement, config.coordinators
    )


def run_process(
    rank: int,
    spec: ModelSpec,
    plan: PartitionPlan,
    config: TrainConfig,
    run: Path,
    start_steps: dict[int, int],
    resume: bool,
    stop: threading.Event,
    placement: Placement,
    on_step: Callable[[dict], None] | None = None,
) -> ShardServer | None:
    """The role of `rank` in the job (see the module docstring). A shard returns its server
    once every shard has written its final checkpoint (None if one failed).

    `on_step(line)` is called with every metrics line this process writes (worker 0 of each
    replica writes them), for a progress bar.
    """
    n, r_count = plan.workers, config.replicas
    halo_timeout = datetime.timedelta(seconds=config.timeout)
    groups = [
        dist.new_group(placement.replica_ranks(r), timeout=halo_timeout) for r in range(r_count)
    ]
    shard_ranks = [placement.shard_rank(s) for s in range(config.shards)]
    shard_group = dist.new_group(shard_ranks, timeout=halo_timeout)
    graph, schedule = plan_schedule(spec, plan, validate=False)  # the launcher validated
    layout = ShardLayout.build(graph, plan.node_map, n, config.shards)
    kind, a, b = placement.roles[rank]
    if kind == "coordinator":
        stats = run_coordinator(config, placement, rank, run)
        write_atomic(run / "coordinator.json", json.dumps(stats, indent=1).encode())
        return None
    if kind == "worker" and config.mode == "sandblaster":
        model = ModelWorker(spec, graph, schedule, b, config.seed, DTYPES[config.dtype])
        tensors = [t for s in model.slices for t in s.param_tensors()]
        run_sandblaster_worker(
            spec, model, tensors, layout, config, a, b, rank, groups[a], placement, _flat_grads,
            _load,
        )  # fmt: skip
        return None
    if kind == "worker":
        _train_worker(
            spec, graph, schedule, layout, config, a, b, rank, groups[a], run,
            start_steps.get(a, 0), stop, placement, on_step,
        )  # fmt: skip
        return None
    server = _serve_shard(spec, plan, layout, config, a, rank, run, resume, stop, placement)
    try:  # after this, every shard's final checkpoint is on disk
        dist.barrier(group=shard_group)
    except RuntimeError as exc:
        log.warning("not every shard finished: %s", _gloo_reason(exc))
        return None
    return server


def _serve_shard(spec, plan, layout, config, shard, rank, run, resume, stop, placement):
    dtype = DTYPES[config.dtype]
    meta = checkpoint_meta(spec, plan, config)
    size = int(layout.shard_sizes()[shard])
    if resume:
        state = load_shard(run, shard, meta, size)
        state.values = state.values.to(dtype)
    else:
        state = ShardState(
            values=initial_values(spec, layout, shard, config.seed, dtype), state=None
        )
    rule = UpdateRule(config.optim, state.values, state.state)
    saving = threading.Lock()

    def save(server: ShardServer, updates: int, final: bool = False) -> None:
        """After update number `updates` (and at the end): a checkpoint every K updates."""
        _fault(rank, updates)  # test hook: a shard "dies" after that many updates
        every = config.snapshot_every
        if every and not final and updates % every == 0:  # kept: run/snapshots/<k>/
            snap = run / "snapshots" / f"{updates // every:05d}"
            save_shard(snap, shard, server.snapshot(), {**meta, "time": time.time()})
        if final or updates % config.checkpoint_every == 0:
            with saving:
                extra = (
                    {
                        "bytes_in": server.bytes_in,
                        "bytes_out": server.bytes_out,
                        "staleness": {str(k): v for k, v in sorted(server.staleness.items())},
                        "lost": {str(r): why for r, why in server.lost.items()},
                    }
                    if final
                    else {}
                )
                save_shard(run, shard, server.snapshot(), {**meta, **extra})

    server = ShardServer(
        layout, shard, config.replicas, config.mode, rule,
        rank_of=placement.worker_rank, rank=rank, state=state, on_update=save,
        dc_lambda=config.dc_lambda, history=config.history,
        coordinator=placement.coordinator_rank() if config.coordinators else None,
    )  # fmt: skip
    log.info("%d values, serving workers %s", size, server.workers)
    server.serve(stop, grace=config.timeout)
    save(server, server.state.updates, final=True)
    log.info(
        "done after %d updates (%.1f MB in, %.1f MB out); lost replicas: %s",
        server.state.updates, server.bytes_in / 1e6, server.bytes_out / 1e6,
        sorted(server.lost) or "none",
    )  # fmt: skip
    return server


def _fault(rank: int, step: int) -> None:
    """Test hook: NETPART_TEST_FAULT=die:RANK@N kills worker RANK at step N, or shard RANK
    after its N-th update."""
    kind, _, where = os.environ.get("NETPART_TEST_FAULT", "").partition(":")
    who, _, when = where.partition("@")
    if kind == "die" and who and int(who) == rank and int(when or 0) == step:
        os._exit(17)


def _train_worker(
    spec, graph, schedule, layout, config, replica, worker, rank, group, run, start, stop,
    placement, on_step,
) -> None:  # fmt: skip
    dtype = DTYPES[config.dtype]
    n, replicas = layout.workers, config.replicas
    model = ModelWorker(spec, graph, schedule, worker, config.seed, dtype)
    tensors = [t for s in model.slices for t in s.param_tensors()]
    if sum(t.numel() for t in tensors) != layout.worker_size(worker):
        raise RuntimeError(f"worker {worker}: slices and shard layout disagree on sizes")
    transport = GlooTransport(group, ranks=placement.replica_ranks(replica))
    shard_ranks = [placement.shard_rank(s) for s in range(config.shards)]
    client = ShardClient(layout, worker, replica, rank, shard_ranks, dtype)
    grads = _GradBuffers(tensors, dtype)
    data = load_data(config.data, spec, config.seed, config.examples)
    sync = config.mode == "sync"
    warm = config.warm_start if (replica > 0 and not sync and start < config.warm_start) else 0
    if warm:
        log.info("waiting for replica 0's %d warm-start steps", warm)
    client.fetch(warm)
    _load(tensors, client.take(wait=True))
    metrics = (run / f"metrics_replica{replica}.jsonl").open("a") if worker == 0 else None
    size = torch.empty(0, dtype=dtype).element_size()
    halo_values = sum(len(u) for layer in schedule.sends for u in layer.values())
    halo_bytes = 2 * halo_values * config.batch * size  # forward and backward, all workers
    ps_values = sum(layout.worker_size(w) for w in range(n))  # one push or fetch, all workers
    unpushed, t = 0, start
    clock = time.perf_counter
    try:
        for t in range(start + 1, config.steps + 1):
            if _agreed(stop, transport, n):
                log.info("stopping before step %d", t)
                t -= 1
                break
            _fault(rank, t)
            t0 = clock()
            fresh = client.take()
            if fresh is not None:
                _load(tensors, fresh)
            t1 = clock()
            x, y = data.batch(replica, replicas, t, config.batch, dtype)
            t2 = clock()
            result = model.step(x, y, transport, collect_grads=False)
            t3 = clock()
            unpushed += 1
            pushed = sync or _push_now(t, config.n_push, config.push_norm, tensors)
            if pushed:
                grads.pushed(client, client.push(grads.flat, t))
                unpushed = 0
            fetched = sync or t % config.n_fetch == 0
            if sync:
                client.fetch(t)
                _load(tensors, client.take(wait=True))
            elif fetched:
                client.fetch()
            t4 = clock()
            if metrics is not None:
                halo_s = sum(result.exchange_s.values())
                line = {
                    "step": t,
                    "replica": replica,
                    "time": time.time(),
                    "loss": result.loss,
                    "accuracy": result.accuracy,
                    "staleness": client.staleness if client.staleness >= 0 else None,
                    "samples": config.batch,
                    "step_s": t4 - t0,
                    "compute_s": (t3 - t2) - halo_s,
                    "halo_s": halo_s,
                    "ps_s": (t1 - t0) + (t4 - t3),
                    "data_s": t2 - t1,
                    "halo_bytes": halo_bytes,
                    "ps_bytes": (int(pushed) + int(fetched)) * ps_values * size,
                }
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
                if on_step is not None:
                    on_step(line)
        if unpushed:
            client.push(grads.flat, t)
        client.close()
    finally:
        if metrics is not None:
            metrics.close()


def _push_now(step: int, n_push: int, push_norm: float, tensors: list[torch.Tensor]) -> bool:
    """Downpour: push every `n_push` steps, and sooner once the accumulated gradient's L2
    norm reaches `push_norm` (when > 0): small gradients wait, large ones go at once."""
    if step % n_push == 0:
        return True
    if push_norm <= 0:
        return False
    square = sum(float(t.grad.square().sum()) for t in tensors if t.grad is not None)
    return square >= push_norm * push_norm


def _agreed(stop: threading.Event, transport: GlooTransport, workers: int) -> bool:
    """Whether the replica stops now: a signal reaches its workers at different moments, so
    they agree (one all-reduce of a flag) lest one leave another waiting in an exchange."""
    if workers == 1:
        return stop.is_set()
    flag = torch.tensor([1.0 if stop.is_set() else 0.0])
    return bool(transport.all_reduce(flag, "max")[0] > 0)


class _GradBuffers:
    """Two flat gradient buffers in the worker's piece order; every parameter's `.grad` is a
    view of the current one, so backward accumulates straight into what a push sends (no
    gather, no allocation per step). After a push the other buffer becomes current: zeroed
    once the client has sent what it held, never while it still reads it."""

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = tensors
        size = sum(t.numel() for t in tensors)
        self.buffers = [torch.zeros(size, dtype=dtype) for _ in range(2)]
        self.sent: list[threading.Event | None] = [None, None]
        self.current = 0
        self._bind()

    @property
    def flat(self) -> torch.Tensor:
        return self.buffers[self.current]

    def pushed(self, client: ShardClient, sent: threading.Event) -> None:
        """The current buffer was pushed (`sent` is set once it is out): switch to the other."""
        self.sent[self.current] = sent
        self.current ^= 1
        if self.sent[self.current] is not None:
            client.wait_sent(self.sent[self.current])
        self.flat.zero_()
        self._bind()

    def _bind(self) -> None:
        for t, view in zip(self.tensors, _views(self.flat, self.tensors), strict=True):
            t.grad = view


def _flat_grads(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1) for t in tensors]
    )


@torch.no_grad()
def _load(tensors: list[torch.Tensor], flat: torch.Tensor | None) -> None:
    """Copy fetched values into the parameters (between steps: no graph has saved them)."""
    if flat is None:
        return
    for t, view in zip(tensors, _views(flat, tensors), strict=True):
        t.copy_(view)


def _views(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` (the tensors' values end to end, as `_flat_grads` lays them) cut into views
    shaped like each tensor."""
    parts = flat.split([t.numel() for t in tensors])
    return [v.view_as(t) for v, t in zip(parts, tensors, strict=True)]
