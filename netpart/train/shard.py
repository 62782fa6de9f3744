"""A parameter-server shard's role in a training job: its state, its mode, its checkpoints.

The shard starts from the reference initialisation of its range (or from its checkpoint on
`--resume`), serves every replica until they are done or lost, writes a checkpoint every
`checkpoint_every` updates (and a kept snapshot every `snapshot_every`), and a final one with
its byte counts, staleness histogram and lost replicas.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from netpart import faults
from netpart.models.spec import ModelSpec
from netpart.partition.shards import ShardLayout, piece_initial
from netpart.ps.checkpoint import load_shard, save_shard
from netpart.ps.lbfgs import ShardVectors
from netpart.ps.modes import Downpour, Mode, Sandblaster, Sync
from netpart.ps.rules import DelayCompensation, make_rule
from netpart.ps.server import ShardServer, ShardSetup, ShardState
from netpart.train.config import TrainConfig
from netpart.train.placement import Placement
from netpart.train.rundir import checkpoint_meta

__all__ = ["initial_values", "serve_shard", "shard_mode"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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


def shard_mode(config: TrainConfig, state: ShardState, placement: Placement) -> Mode:
    """The mode object of `config.mode`, over the shard's values (and optimizer state)."""
    if config.mode == "sandblaster":
        vectors = ShardVectors(state.values, config.history)
        return Sandblaster(vectors, placement.coordinator_rank(), config.timeout)
    rule = make_rule(config.optim, state.values, state.state)
    if config.mode == "sync":
        return Sync(rule)
    return Downpour(rule, DelayCompensation(config.dc_lambda) if config.dc_lambda else None)


def serve_shard(job, layout: ShardLayout, shard: int, rank: int, stop, placement) -> ShardServer:
    """Serve shard `shard` of `job` until the replicas are done; returns the server."""
    spec, plan, config, run = job.spec, job.plan, job.config, job.run
    dtype = DTYPES[config.dtype]
    meta = checkpoint_meta(spec, plan, config)
    size = int(layout.shard_sizes()[shard])
    if job.resume:
        state = load_shard(run, shard, meta, size)
        state.values = state.values.to(dtype)
        _catch_up(state, dict(job.starts), config.mode == "sync")
    else:
        values = initial_values(spec, layout, shard, config.seed, dtype)
        state = ShardState(values=values, state=None)
    saving = threading.Lock()

    def save(server: ShardServer, updates: int, final: bool = False) -> None:
        """After update number `updates` (and at the end): a checkpoint every K updates."""
        faults.point(rank, updates)  # test hook: a shard "dies" after that many updates
        every = config.snapshot_every
        if every and not final and updates % every == 0:  # kept: run/snapshots/<k>/
            snap = run / "snapshots" / f"{updates // every:05d}"
            save_shard(snap, shard, server.snapshot(), {**meta, "time": time.time()})
        if final or updates % config.checkpoint_every == 0:
            with saving:
                extra = _final_figures(server) if final else {}
                save_shard(run, shard, server.snapshot(), {**meta, **extra})

    setup = ShardSetup(layout, shard, config.replicas, rank, placement.worker_rank)
    server = ShardServer(setup, state, shard_mode(config, state, placement), on_update=save)
    log.info("%d values, serving workers %s", size, server.workers)
    server.serve(stop, grace=config.timeout)
    save(server, server.state.updates, final=True)
    log.info(
        "done after %d updates (%.1f MB in, %.1f MB out); lost replicas: %s",
        server.state.updates, server.bytes_in / 1e6, server.bytes_out / 1e6,
        sorted(server.lost) or "none",
    )  # fmt: skip
    return server


def _catch_up(state: ShardState, starts: dict[int, int], sync: bool) -> None:
    """A shard restored from a checkpoint older than where the replicas restart (it died and
    was restarted) takes their steps as its own: sync applies step `start` + 1 next, and a
    replica's progress is where it restarts. What it missed is in the run's summary."""
    if sync and starts:
        state.clock = max(state.clock, min(starts.values()))
    for r, s in starts.items():
        state.progress[r] = max(state.progress.get(r, 0), s)


def _final_figures(server: ShardServer) -> dict:
    return {
        "bytes_in": server.bytes_in,
        "bytes_out": server.bytes_out,
        "staleness": {str(k): v for k, v in sorted(server.staleness.items())},
        "lost": {str(r): why for r, why in server.lost.items()},
    }
