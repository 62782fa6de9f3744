"""A parameter-server shard's role in a training job: its state, its mode, its checkpoints.

The shard starts from the reference initialisation of its range (or from its checkpoint on
`--resume`) and serves every replica until they are done or lost. What it writes and when is
decided in one place, `Checkpoints`: a checkpoint every `checkpoint_every` updates (and a kept
snapshot every `snapshot_every`), and a final one with its byte counts, staleness histogram
and lost replicas.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path

import torch

from netpart import faults
from netpart.compile.shards import ShardLayout, piece_index, piece_initial
from netpart.errors import RuntimeFailure, write_reason
from netpart.files import write_atomic
from netpart.models.reference import DTYPES
from netpart.models.spec import ModelSpec
from netpart.ps.checkpoint import keep_previous, load_shard, restore_previous, save_shard
from netpart.ps.lbfgs_vectors import ShardVectors
from netpart.ps.modes import Downpour, Mode, Sandblaster, Sync
from netpart.ps.rules import DelayCompensation, UpdateRule, make_rule
from netpart.ps.server import ShardServer, ShardSetup, ShardState
from netpart.train.config import TrainConfig
from netpart.train.rundir import checkpoint_meta, read_initial

__all__ = ["Checkpoints", "initial_values", "serve_shard", "shard_mode"]

log = logging.getLogger(__name__)


def initial_values(
    spec: ModelSpec,
    layout: ShardLayout,
    shard: int,
    seed: int,
    dtype: torch.dtype,
    start: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shard `shard`'s initial values: the reference initialisation of the pieces it holds,
    or, given `start` (reference parameter name -> values: --init module's), those."""
    lo, hi = int(layout.bounds[shard]), int(layout.bounds[shard + 1])
    out = torch.zeros(hi - lo, dtype=dtype)
    done: set[int] = set()
    for w in range(layout.workers):  # loops over pieces (tens per worker), not values
        for piece, off in zip(layout.pieces[w], layout.offsets[w].tolist(), strict=True):
            a, b = max(off, lo), min(off + piece.size, hi)
            if a >= b or off in done or (piece.param == "bias" and start is None):
                continue
            done.add(off)
            if start is None:
                values = torch.from_numpy(piece_initial(spec, seed, piece))
            else:
                flat = start[piece.name].reshape(-1)
                values = flat[torch.from_numpy(piece_index(spec, piece))]
            out[a - lo : b - lo] = values[a - off : b - off].to(dtype)
    return out


def shard_mode(
    config: TrainConfig, state: ShardState, workers: tuple[int, ...]
) -> tuple[Mode, UpdateRule | None]:
    """The mode object of `config.cluster.mode` and the update rule over the shard's values (and
    optimizer state); `workers`: the model workers the shard serves."""
    if config.cluster.mode == "sandblaster":  # the coordinator moves x by vector operations
        vectors = ShardVectors(state.values, config.optimiser.history)
        return Sandblaster(vectors, workers, config.cluster.timeout), None
    rule = make_rule(config.optim, state.values, state.state)
    if config.cluster.mode == "sync":
        return Sync(), rule
    return Downpour(
        DelayCompensation(config.optimiser.dc_lambda) if config.optimiser.dc_lambda else None
    ), rule


def serve_shard(job, layout: ShardLayout, shard: int, rank: int, stop, placement) -> ShardServer:
    """Serve shard `shard` of `job` until the replicas are done; returns the server."""
    spec, plan, config, run = job.spec, job.plan, job.config, job.run
    dtype = DTYPES[config.run.dtype]
    meta = checkpoint_meta(spec, plan, config)
    size = int(layout.shard_sizes()[shard])
    if job.resume:
        state = load_shard(run, shard, meta, size)
        state.values = state.values.to(dtype)
        _catch_up(state, dict(job.starts), config.cluster.mode == "sync")
    else:
        start = read_initial(run) if config.model.init == "module" else None
        values = initial_values(spec, layout, shard, config.run.seed, dtype, start)
        state = ShardState(values=values, state=None)
    mode, rule = shard_mode(config, state, tuple(layout.peers(shard)))
    coordinator = placement.coordinator_rank() if config.cluster.mode == "sandblaster" else -1
    setup = ShardSetup(
        layout, shard, config.cluster.replicas, rank, placement.worker_rank, coordinator
    )
    server = ShardServer(setup, state, mode, rule)
    checkpoints = Checkpoints(server, run, meta, config, rank)  # before any update
    log.info("%d values, serving workers %s", size, server.workers)
    try:
        server.serve(stop, grace=config.cluster.timeout)
    finally:
        failed = checkpoints.close(final=_final_figures(server))  # on disk, or why not
    if failed is not None:
        raise RuntimeFailure(f"shard {shard}: {failed}")
    log.info(
        "done after %d updates (%.1f MB in, %.1f MB out); lost replicas: %s",
        server.state.updates,
        server.bytes_in / 1e6,
        server.bytes_out / 1e6,
        sorted(server.lost) or "none",
    )
    return server


class Checkpoints:
    """What a shard writes and when, from a thread of its own: after every `checkpoint_every`
    updates a checkpoint (`run/shard_<s>.pt`), after every `snapshot_every` a kept snapshot
    (`run/snapshots/<k>/`), at the end (`close`) a final checkpoint with the shard's figures.

    The thread waits for the server's update count to reach the next due count, copies a
    consistent state and writes it: no peer's thread waits for a write, and the server calls
    nothing back. A failed write makes the server fail (`serve` raises); `close` says why.
    Test hook: with a fault set for this rank, the thread looks at every update and reaches
    fault point n after update n (a shard "dies" after that many updates), each checkpoint
    holds exactly the update count it fell due at and is written before any later fault
    point (however far the thread lags behind the server), and checkpoint write number k may
    fail with ENOSPC (`netpart.faults`)."""

    def __init__(self, server: ShardServer, run: Path, meta: dict, config: TrainConfig, rank: int):
        self.server, self.run, self.meta, self.rank = server, run, meta, rank
        self.every, self.snapshot_every = config.run.checkpoint_every, config.run.snapshot_every
        self.seen = server.state.updates
        # a test's death after update n finds each checkpoint before it at its own count
        self.exact = faults.active(rank) and not self.snapshot_every
        if self.exact:
            server.keep_at((self.seen // self.every + 1) * self.every, every=self.every)
        self.writes = 0
        self.wrote = False  # whether this job wrote the current checkpoint
        self.froze = False
        self.error: str | None = None
        self._closing = threading.Event()
        torch.save({"values": torch.zeros(1)}, io.BytesIO())  # its first call imports
        self.thread = threading.Thread(target=self._watch, name="checkpoints", daemon=True)
        self.thread.start()

    def _next_due(self) -> int:
        """The update count to wake at: the next multiple of either period (every update
        where a fault is set for this rank)."""
        if faults.active(self.rank):
            return self.seen + 1
        periods = [p for p in (self.every, self.snapshot_every) if p]
        return min((self.seen // p + 1) * p for p in periods)

    def _watch(self) -> None:
        asked = 0
        while not self._closing.is_set():
            if self.snapshot_every and asked <= self.seen:  # the next snapshot, exactly
                asked = (self.seen // self.snapshot_every + 1) * self.snapshot_every
                self.server.keep_at(asked)
            self._look(self.server.wait_update(self._next_due(), timeout=0.5))

    def _look(self, updates: int) -> None:
        """Updates up to `updates` were applied: reach their fault points, and write what
        fell due (one checkpoint and one snapshot at most: a checkpoint of the state as it is now,
        a snapshot of the state the server kept at its update count; with `exact`, each
        checkpoint as the server kept it at its own count, written before the next fault
        point)."""
        due, snapshot = False, None
        for k in range(self.seen + 1, updates + 1):
            if due and self.exact:
                self._write(self.run, self._kept_at(k - 1), self.meta)  # before a later death
                due = False
            faults.point(self.rank, k)
            due |= k % self.every == 0
            if self.snapshot_every and k % self.snapshot_every == 0:
                snapshot = k // self.snapshot_every
        self.seen = max(self.seen, updates)
        if snapshot is not None:
            kept = self.server.kept()  # taken at the snapshot's own update count
            exact = kept is not None and kept.updates == snapshot * self.snapshot_every
            where = self.run / "snapshots" / f"{snapshot:05d}"
            state = kept if exact else self.server.snapshot()
            self._write(where, state, {**self.meta, "time": time.time()})
        if due:
            now = self._kept_at(updates) if self.exact else self.server.snapshot()
            self._write(self.run, now, self.meta)

    def _kept_at(self, updates: int) -> ShardState:
        """The state the server kept at exactly `updates` (a test's checkpoint), else now."""
        kept = self.server.kept(updates)
        return kept if kept is not None else self.server.snapshot()

    def _write(self, where: Path, state: ShardState, meta: dict) -> None:
        if self.error is not None or self._diverged(state):
            return
        self.writes += 1
        try:
            faults.write_fails(self.rank, self.writes)
            if where == self.run:
                keep_previous(self.run, self.server.shard)
            save_shard(where, self.server.shard, state, meta)
            if where == self.run:
                self.wrote = True
        except OSError as exc:  # disk full, read-only: this shard cannot go on
            self.error = write_reason(exc)
            self.server.fail(self.error)

    def _diverged(self, state: ShardState) -> bool:
        """Whether training diverged (a replica's loss was not finite, or these values are
        not): then no checkpoint replaces the last good one, and `diverged.json` says where
        it stands."""
        server = self.server
        if server.diverged is None and not bool(torch.isfinite(state.values).all()):
            server.diverged = (-1, 0)  # the values themselves: no replica saw it first
        if server.diverged is None:
            return False
        if not self.froze:
            self.froze = True
            # The newest checkpoint this job wrote may already hold a diverged state (the
            # loss shows it only steps later): the one before it is put back.
            if self.wrote:
                restore_previous(self.run, server.shard)
            replica, step = server.diverged
            note = {"replica": replica, "step": step, "shard": server.shard}
            log.warning("training diverged (%s); the checkpoint before it stays", note)
            write_atomic(self.run / f"diverged_{server.shard}.json", json.dumps(note).encode())
        return True

    def close(self, final: dict) -> str | None:
        """Stop watching, write what fell due and the final checkpoint (with `final`'s
        figures); why a write failed, or None."""
        self._closing.set()
        self.thread.join()
        updates = self.server.state.updates
        self._look(updates)
        self._write(self.run, self.server.snapshot(), {**self.meta, **final})
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
