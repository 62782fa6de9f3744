"""A parameter-server shard's role in a training job: its state, its mode, its checkpoints.

The shard starts from the reference initialisation of its range (or from its checkpoint on
`--resume`), serves every replica until they are done or lost, writes a checkpoint every
`checkpoint_every` updates (and a kept snapshot every `snapshot_every`), and a final one with
its byte counts, staleness histogram and lost replicas.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time

import torch

from netpart import faults
from netpart.errors import RuntimeFailure, write_reason
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

    def save(server: ShardServer, updates: int, final: bool = False) -> None:
        """After update number `updates` (and at the end): a checkpoint every K updates."""
        faults.point(rank, updates)  # test hook: a shard "dies" after that many updates
        every = config.snapshot_every
        if every and not final and updates % every == 0:  # kept: run/snapshots/<k>/
            snap = run / "snapshots" / f"{updates // every:05d}"
            writer.put(snap, {**meta, "time": time.time()})
        if final or updates % config.checkpoint_every == 0:
            writer.put(run, {**meta, **(_final_figures(server) if final else {})})

    setup = ShardSetup(layout, shard, config.replicas, rank, placement.worker_rank)
    server = ShardServer(setup, state, shard_mode(config, state, placement), on_update=save)
    writer = _Writer(server)  # before any update: `serve` has not started
    log.info("%d values, serving workers %s", size, server.workers)
    try:
        server.serve(stop, grace=config.timeout)
        save(server, server.state.updates, final=True)
    finally:
        failed = writer.close()  # every checkpoint taken is on disk, or why not
    if failed is not None:
        raise RuntimeFailure(f"shard {shard}: {failed}")
    log.info(
        "done after %d updates (%.1f MB in, %.1f MB out); lost replicas: %s",
        server.state.updates, server.bytes_in / 1e6, server.bytes_out / 1e6,
        sorted(server.lost) or "none",
    )  # fmt: skip
    return server


class _Writer:
    """Writes a shard's checkpoints from a thread of its own, in the order they were taken: a
    peer's thread only takes the snapshot (the write and its fsyncs, milliseconds, no longer
    hold up that peer's next request). A failed write makes the server fail (`serve` raises);
    `close` waits for what is queued and says why the first failed write failed."""

    def __init__(self, server: ShardServer) -> None:
        self.server = server
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.order = threading.Lock()  # snapshot and queue together: writes keep their order
        self.error: str | None = None
        torch.save({"values": torch.zeros(1)}, io.BytesIO())  # its first call imports
        self.thread = threading.Thread(target=self._run, name="checkpoints", daemon=True)
        self.thread.start()

    def put(self, where, meta: dict) -> None:
        with self.order:
            self.queue.put((where, self.server.snapshot(), meta))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            where, snapshot, meta = item
            if self.error is not None:
                continue
            try:
                save_shard(where, self.server.shard, snapshot, meta)
            except OSError as exc:  # disk full, read-only: this shard cannot go on
                self.error = write_reason(exc)
                self.server.fail(self.error)

    def close(self) -> str | None:
        self.queue.put(None)
        self.thread.join()
        return self.error


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
