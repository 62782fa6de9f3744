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
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.data import load_data
from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.partition.shards import ShardLayout, piece_initial
from netpart.runtime.checkpoint import checkpoint_meta, load_shard, save_shard
from netpart.runtime.config import TrainConfig
from netpart.runtime.ps import ShardClient, ShardServer, ShardState
from netpart.runtime.schedule import plan_schedule
from netpart.runtime.transport import GlooTransport
from netpart.runtime.updates import UpdateRule
from netpart.runtime.worker import ModelWorker

__all__ = ["initial_values", "run_process"]

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


def run_process(
    rank: int,
    spec: ModelSpec,
    plan: PartitionPlan,
    config: TrainConfig,
    run: Path,
    start_steps: dict[int, int],
    resume: bool,
    stop: threading.Event,
) -> None:
    """The role of `rank` in the job (see the module docstring)."""
    n, r_count = plan.workers, config.replicas
    halo_timeout = datetime.timedelta(seconds=config.timeout)
    groups = [
        dist.new_group(list(range(r * n, (r + 1) * n)), timeout=halo_timeout)
        for r in range(r_count)
    ]
    graph, schedule = plan_schedule(spec, plan, validate=False)  # the launcher validated
    layout = ShardLayout.build(graph, plan.node_map, n, config.shards)
    if rank < r_count * n:
        replica, worker = divmod(rank, n)
        _train_worker(
            spec, graph, schedule, layout, config, replica, worker, rank, groups[replica], run,
            start_steps.get(replica, 0), stop,
        )  # fmt: skip
    else:
        _serve_shard(spec, plan, layout, config, rank - r_count * n, rank, run, resume, stop)


def _serve_shard(spec, plan, layout, config, shard, rank, run, resume, stop) -> None:
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
        if final or updates % config.checkpoint_every == 0:
            with saving:
                extra = (
                    {"bytes_in": server.bytes_in, "bytes_out": server.bytes_out} if final else {}
                )
                save_shard(run, shard, server.snapshot(), {**meta, **extra})

    n = layout.workers
    server = ShardServer(
        layout, shard, config.replicas, config.mode, rule,
        rank_of=lambda r, w: r * n + w, rank=rank, state=state, on_update=save,
    )  # fmt: skip
    log.info("shard %d: %d values, serving workers %s", shard, size, server.workers)
    server.serve(stop, grace=config.timeout)
    save(server, server.state.updates, final=True)
    log.info(
        "shard %d: done after %d updates (%.1f MB in, %.1f MB out); lost replicas: %s",
        shard, server.state.updates, server.bytes_in / 1e6, server.bytes_out / 1e6,
        sorted(server.lost) or "none",
    )  # fmt: skip


def _fault(rank: int, step: int) -> None:
    """Test hook: NETPART_TEST_FAULT=die:RANK@N kills worker RANK at step N, or shard RANK
    after its N-th update."""
    kind, _, where = os.environ.get("NETPART_TEST_FAULT", "").partition(":")
    who, _, when = where.partition("@")
    if kind == "die" and who and int(who) == rank and int(when or 0) == step:
        os._exit(17)


def _train_worker(
    spec, graph, schedule, layout, config, replica, worker, rank, group, run, start, stop
) -> None:
    dtype = DTYPES[config.dtype]
    n, replicas = layout.workers, config.replicas
    model = ModelWorker(spec, graph, schedule, worker, config.seed, dtype)
    tensors = [t for s in model.slices for t in s.param_tensors()]
    if sum(t.numel() for t in tensors) != layout.worker_size(worker):
        raise RuntimeError(f"worker {worker}: slices and shard layout disagree on sizes")
    transport = GlooTransport(group, ranks=list(range(replica * n, (replica + 1) * n)))
    client = ShardClient(
        layout, worker, replica, rank, [replicas * n + s for s in range(config.shards)], dtype
    )
    data = load_data(config.data, spec, config.seed, config.examples)
    sync = config.mode == "sync"
    warm = config.warm_start if (replica > 0 and not sync and start < config.warm_start) else 0
    if warm:
        log.info(
            "replica %d worker %d: waiting for replica 0's %d warm-start steps",
            replica,
            worker,
            warm,
        )
    client.fetch(warm)
    _load(tensors, client.take(wait=True))
    metrics = (run / f"metrics_replica{replica}.jsonl").open("a") if worker == 0 else None
    unpushed, t, t0 = 0, start, time.perf_counter()
    try:
        for t in range(start + 1, config.steps + 1):
            if stop.is_set():
                log.info("replica %d worker %d: stopping at step %d", replica, worker, t)
                t -= 1
                break
            _fault(rank, t)
            fresh = client.take()
            if fresh is not None:
                _load(tensors, fresh)
            x, y = data.batch(replica, replicas, t, config.batch, dtype)
            result = model.step(x, y, transport, collect_grads=False)
            unpushed += 1
            if sync or t % config.n_push == 0:
                client.push(_flat_grads(tensors), t)
                model.zero_grad()
                unpushed = 0
            if sync:
                client.fetch(t)
                _load(tensors, client.take(wait=True))
            elif t % config.n_fetch == 0:
                client.fetch()
            if metrics is not None:
                line = {"step": t, "loss": result.loss, "time": time.perf_counter() - t0}
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
        if unpushed:
            client.push(_flat_grads(tensors), t)
        client.close()
    finally:
        if metrics is not None:
            metrics.close()


def _flat_grads(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1) for t in tensors]
    )


@torch.no_grad()
def _load(tensors: list[torch.Tensor], flat: torch.Tensor | None) -> None:
    """Copy fetched values into the parameters (between steps: no graph has saved them)."""
    if flat is None:
        return
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view_as(t))
        off += t.numel()
