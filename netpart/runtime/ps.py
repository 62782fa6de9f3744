"""The parameter server: shard processes and the client each model worker talks to them with.

Every byte moves over torch.distributed point-to-point on the default (world) process group.
A message is a header, int64 [kind, sender, shard, step, length, replica, extra] (tag 1),
then for PUSH and PARAMS a payload of `length` values (tag 2); a FETCH is a header alone.
`extra` of a PUSH is the shard version its gradient was computed on; of a PARAMS reply, the
staleness of that peer's last applied push (-1: none yet). Lengths come
from the `ShardLayout`: worker w's message to shard s carries exactly the segments of w's flat
parameter vector that s holds, so both sides know every size before anything moves.

`ShardServer` serves each (replica, worker) peer from its own thread (gloo isolates pairs: a
dead peer fails only its own thread), and applies updates under one lock:
- downpour: each push is applied on arrival; a fetch is answered at once (with `step` > 0:
  once replica 0 has pushed that step, the warm start);
- sync: pushes for step t are summed per replica; when every live replica's workers have
  pushed, the mean over replicas is applied once; fetches for step t wait for that.
A peer whose connection fails marks its whole replica lost: the shard keeps serving the rest.
Staleness of a push = updates the shard applied between serving the values the gradient was
computed on and applying it (0 in sync mode); the shard keeps a histogram of it.

The worker's side, `ShardClient`, is in `netpart.runtime.ps_client`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from netpart.errors import RuntimeFailure
from netpart.partition.shards import Segment, ShardLayout
from netpart.runtime.lbfgs import ShardVectors, code_name
from netpart.runtime.transport import _gloo_reason
from netpart.runtime.updates import UpdateRule, delay_compensated

__all__ = ["Kind", "Op", "ProtocolError", "ShardServer", "ShardState"]

log = logging.getLogger(__name__)

HEADER_LEN = 7
TAG_HEADER, TAG_PAYLOAD = 1, 2
TAG_CHUNK = 16  # chunk i of a push travels with tag TAG_CHUNK + i
CHUNK = 1 << 18  # values per push chunk
MODES = ("downpour", "sync", "sandblaster")
DC_KEPT = 4  # DC-ASGD: served versions kept per peer


class Kind(IntEnum):
    PUSH = 1
    FETCH = 2
    PARAMS = 3
    BYE = 4
    CMD = 5  # Sandblaster: coordinator -> shard, a vector operation
    REPLY = 6  # shard -> coordinator: its result
    UNIT = 7  # coordinator -> worker: compute this work unit
    DONE = 8  # worker 0 of a replica -> coordinator: unit finished, with its loss sum


class Op(IntEnum):
    """Sandblaster's shard operations (`Kind.CMD`; args float64 [alpha, a, b, c])."""

    DOT = 1
    ABS_SUM = 2
    ABS_MAX = 3
    AXPY = 4
    COPY = 5
    SCALE = 6
    DIFF = 7
    KEEP_PAIR = 8
    BEGIN = 9  # a new evaluation: zero the batch gradient, forget the units received
    WAIT = 10  # answer once every worker's part of `alpha` units has arrived
    STOP = 11


class ProtocolError(RuntimeFailure):
    """A message whose header disagrees with the layout (wrong sender, shard or length)."""


def _header(
    kind: Kind, sender: int, shard: int, step: int, length: int, replica: int, extra: int = -1
):
    return torch.tensor([int(kind), sender, shard, step, length, replica, extra], dtype=torch.int64)


def _length(segments: tuple[Segment, ...]) -> int:
    return sum(s.length for s in segments)


def _chunks(n: int) -> list[tuple[int, int]]:
    """[a, b) ranges of a push payload of n values, CHUNK values each (the last shorter)."""
    cuts = [*range(0, n, CHUNK), n]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a] or [(0, 0)]


def _post_chunks(payload: torch.Tensor, src: int) -> list[tuple[tuple[int, int], dist.Work]]:
    """Post the receives of a push's chunks into `payload`: ((a, b), work) per chunk."""
    return [
        ((a, b), dist.irecv(payload[a:b], src=src, tag=TAG_CHUNK + i))
        for i, (a, b) in enumerate(_chunks(payload.numel()))
    ]


def _overlaps(segments: tuple[Segment, ...], a: int, b: int):
    """(payload lo, payload hi, shard offset) of the parts of `segments` in payload [a, b)."""
    off = 0
    for seg in segments:
        lo, hi = max(a, off), min(b, off + seg.length)
        if lo < hi:
            yield lo, hi, seg.shard_lo + lo - off
        off += seg.length


@dataclass
class ShardState:
    """What a shard checkpoints: values, optimizer state, and how far each replica got."""

    values: torch.Tensor
    state: torch.Tensor | None
    clock: int = 0  # sync: last step applied
    updates: int = 0  # updates applied (pushes in downpour, steps in sync)
    progress: dict[int, int] = field(default_factory=dict)  # replica -> last step pushed


class ShardServer:
    """Shard `shard` of the layout, serving `replicas` replicas of the partitioned model."""

    def __init__(
        self,
        layout: ShardLayout,
        shard: int,
        replicas: int,
        mode: str,
        rule: UpdateRule,
        rank_of: Callable[[int, int], int],
        rank: int,
        state: ShardState,
        on_update: Callable[[ShardServer, int], None] | None = None,
        dc_lambda: float = 0.0,
        coordinator: int | None = None,
        history: int = 10,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.layout, self.shard, self.replicas, self.mode = layout, shard, replicas, mode
        self.rule, self.rank_of, self.rank, self.state = rule, rank_of, rank, state
        self.on_update = on_update
        self.workers = layout.peers(shard)
        self.routes = {w: layout.routes(w)[shard] for w in self.workers}  # cached by the layout
        self.size = int(layout.shard_sizes()[shard])
        self.cond = threading.Condition()
        self.lost: dict[int, str] = {}  # replica -> why
        self.done: set[tuple[int, int]] = set()
        self.pushed = {
            (r, w): state.progress.get(r, 0) for r in range(replicas) for w in self.workers
        }
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # sync: step -> replica -> sum
        self.arrived: dict[int, set[tuple[int, int]]] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.staleness: collections.Counter[int] = collections.Counter()
        self.last_staleness: dict[tuple[int, int], int] = {}
        # DC-ASGD: per peer, the values last served to it, by version (the newest few).
        self.dc_lambda = dc_lambda
        self.served: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        # Sandblaster: the L-BFGS vectors (x is the values), the evaluation being accumulated.
        self.coordinator = coordinator
        self.coordinator_done = coordinator is None
        self.vectors = ShardVectors(rule.values, history) if mode == "sandblaster" else None
        self.eval_id = -1
        self.units_in: dict[int, set[int]] = {w: set() for w in self.workers}
        self.duplicates = 0  # backup copies of units that arrived second (dropped)

    # ---- serving -------------------------------------------------------------------------
    def serve(self, stop: threading.Event | None = None, grace: float = 60.0) -> None:
        """Serve until every peer said goodbye or was lost (or `grace` s after `stop` is set)."""
        threads = [
            threading.Thread(target=self._peer, args=(r, w), daemon=True, name=f"peer-{r}-{w}")
            for r in range(self.replicas)
            for w in self.workers
        ]
        if self.coordinator is not None:
            threads.append(threading.Thread(target=self._commands, daemon=True, name="commands"))
        for t in threads:
            t.start()
        deadline = None
        with self.cond:
            while not self._finished():
                if stop is not None and stop.is_set() and deadline is None:
                    log.info("shard %d: stopping; waiting %.0f s for workers", self.shard, grace)
                    deadline = time.monotonic() + grace
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("shard %d: workers did not finish in time", self.shard)
                    break
                self.cond.wait(timeout=0.2)

    def _finished(self) -> bool:
        return self.coordinator_done and all(
            (r, w) in self.done or r in self.lost
            for r in range(self.replicas)
            for w in self.workers
        )

    def _peer(self, replica: int, worker: int) -> None:
        src = self.rank_of(replica, worker)
        segments = self.routes[worker]
        n = _length(segments)
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        payload = torch.empty(n, dtype=self.state.values.dtype)
        try:
            while True:
                dist.recv(header, src=src, tag=TAG_HEADER)
                kind, sender, shard, step, length, rep, extra = header.tolist()
                if (sender, shard, rep) != (src, self.shard, replica):
                    raise ProtocolError(
                        f"shard {self.shard}: header from rank {src} says sender {sender}, "
                        f"shard {shard}, replica {rep}"
                    )
                if kind == Kind.PUSH:
                    if length != n:
                        raise ProtocolError(
                            f"shard {self.shard}: push of {length} values from replica "
                            f"{replica} worker {worker}, the layout says {n}"
                        )
                    if self.vectors is not None:
                        self._receive_unit(worker, step, extra, payload, segments, src)
                    else:
                        self._receive_push(replica, worker, step, payload, segments, src, extra)
                    with self.cond:  # peers run in threads: count under the lock
                        self.bytes_in += payload.numel() * payload.element_size()
                elif kind == Kind.FETCH:
                    out, version = self._snapshot_when_ready(replica, step, segments)
                    if self.dc_lambda:
                        self._remember(replica, worker, version, out)
                    stale = self.last_staleness.get((replica, worker), -1)
                    dist.send(
                        _header(Kind.PARAMS, self.rank, self.shard, version, n, replica, stale),
                        dst=src,
                        tag=TAG_HEADER,
                    )
                    dist.send(out, dst=src, tag=TAG_PAYLOAD)
                    with self.cond:
                        self.bytes_out += out.numel() * out.element_size()
                elif kind == Kind.BYE:
                    with self.cond:
                        self.done.add((replica, worker))
                        applied = self._apply_complete_steps()  # sync: stop waiting for it
                        count = self.state.updates
                        self.cond.notify_all()
                    if applied and self.on_update is not None:
                        self.on_update(self, count)
                    return
                else:
                    raise ProtocolError(f"shard {self.shard}: unknown message kind {kind}")
        except (RuntimeError, ProtocolError) as exc:
            reason = str(exc) if isinstance(exc, ProtocolError) else _gloo_reason(exc)
            self.lose(replica, f"worker {worker}: {reason}")

    # ---- Sandblaster ----------------------------------------------------------------------
    def _receive_unit(self, worker, unit, eval_id, payload, segments, src) -> None:
        """Add a unit's gradient into the batch gradient, once per (unit, worker) part."""
        for _, work in _post_chunks(payload, src):
            work.wait()
        with self.cond:
            if eval_id != self.eval_id or unit in self.units_in[worker]:
                self.duplicates += 1  # a backup that lost, or a unit of an older evaluation
                return
            self.units_in[worker].add(unit)
            g = self.vectors.vectors["g"]
            for lo, hi, at in _overlaps(segments, 0, payload.numel()):
                g[at : at + hi - lo] += payload[lo:hi]
            self.cond.notify_all()

    def _commands(self) -> None:
        """Serve the coordinator's vector operations; each gets a one-value reply."""
        src = self.coordinator
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        args = torch.empty(4, dtype=torch.float64)
        try:
            while True:
                dist.recv(header, src=src, tag=TAG_HEADER)
                op = Op(int(header[3]))
                dist.recv(args, src=src, tag=TAG_PAYLOAD)
                value = self.command(op, *args.tolist())
                if op == Op.WAIT and self.on_update is not None:  # an evaluation is complete
                    self.on_update(self, self.state.updates)
                reply = _header(Kind.REPLY, self.rank, self.shard, int(op), 1, 0)
                dist.send(reply, dst=src, tag=TAG_HEADER)
                dist.send(torch.tensor([value], dtype=torch.float64), dst=src, tag=TAG_PAYLOAD)
                if op == Op.STOP:
                    break
        except RuntimeError as exc:
            log.warning("shard %d: coordinator lost (%s)", self.shard, _gloo_reason(exc))
        with self.cond:
            self.coordinator_done = True
            self.cond.notify_all()

    def command(self, op: Op, alpha: float, a: float, b: float, c: float) -> float:
        """Run one coordinator operation on this shard's vectors (names come as codes)."""
        v = self.vectors
        na, nb, nc = (code_name(int(x)) for x in (a, b, c))
        with self.cond:
            if op == Op.WAIT:
                n = int(alpha)
                while not all(len(self.units_in[w]) >= n for w in self.workers):
                    self.cond.wait(timeout=0.2)
                self.state.updates += 1
                return 0.0
            if op == Op.BEGIN:
                self.eval_id = int(alpha)
                self.units_in = {w: set() for w in self.workers}
                v.vectors["g"].zero_()
                return 0.0
            reductions = {Op.DOT: lambda: v.dot(na, nb), Op.ABS_SUM: lambda: v.abs_sum(na),
                          Op.ABS_MAX: lambda: v.abs_max(na)}  # fmt: skip
            if op in reductions:
                return reductions[op]()
            if op == Op.AXPY:
                v.axpy(alpha, na, nb)
            elif op == Op.COPY:
                v.copy(na, nb)
            elif op == Op.SCALE:
                v.scale(na, alpha)
            elif op == Op.DIFF:
                v.diff(na, nb, nc)
            elif op == Op.KEEP_PAIR:
                v.keep_pair()
            return 0.0

    def lose(self, replica: int, why: str) -> None:
        """Stop waiting for `replica`: its pushes in flight are dropped, its fetches answered."""
        with self.cond:
            if replica not in self.lost:
                log.warning("shard %d: replica %d lost (%s)", self.shard, replica, why)
                self.lost[replica] = why
                self._apply_complete_steps()
            self.cond.notify_all()

    def _receive_push(self, replica, worker, step, payload, segments, src, version) -> None:
        """Receive a push in chunks and fold each into the shard as soon as it lands, so the
        update of one chunk overlaps the transfer of the next."""
        posted = _post_chunks(payload, src)
        then = self._served_values(replica, worker, version)
        for (a, b), work in posted:
            work.wait()
            self._fold_chunk(replica, step, payload, segments, a, b, then)
        self._finish_push(replica, worker, step, version)

    def _fold(self, replica, worker, step, payload, segments, version: int = -1) -> None:
        """Fold a whole push that is already in memory (what `_receive_push` does by parts)."""
        then = self._served_values(replica, worker, version)
        self._fold_chunk(replica, step, payload, segments, 0, payload.numel(), then)
        self._finish_push(replica, worker, step, version)

    def _fold_chunk(self, replica, step, payload, segments, a: int, b: int, then=None) -> None:
        """Downpour: apply payload[a:b] now (delay-compensated against `then`, the values the
        gradient was computed on, when given). Sync: add it to the replica's sum for `step`."""
        with self.cond:
            if replica in self.lost:
                return
            if self.mode == "downpour":
                into = None
            else:
                pending = self.pending.setdefault(step, {})
                if replica not in pending:
                    pending[replica] = torch.zeros(self.size, dtype=payload.dtype)
                into = pending[replica]
            for lo, hi, at in _overlaps(segments, a, b):
                if into is None and then is not None:
                    now = self.rule.values[at : at + hi - lo]
                    grad = delay_compensated(payload[lo:hi], now, then[lo:hi], self.dc_lambda)
                    self.rule.apply(at, grad)
                elif into is None:
                    self.rule.apply(at, payload[lo:hi])
                else:
                    into[at : at + hi - lo] += payload[lo:hi]

    def _finish_push(self, replica, worker, step, version: int = -1) -> None:
        with self.cond:
            if replica in self.lost:
                return
            self.pushed[(replica, worker)] = step
            self.state.progress[replica] = min(self.pushed[(replica, w)] for w in self.workers)
            if version >= 0:  # sync: the values of step t-1 are still in place (staleness 0)
                now = self.state.updates if self.mode == "downpour" else self.state.clock
                stale = max(0, now - version)
                self.staleness[stale] += 1
                self.last_staleness[(replica, worker)] = stale
            if self.mode == "downpour":
                self.state.updates += 1
                applied = True
            else:
                self.arrived.setdefault(step, set()).add((replica, worker))
                applied = self._apply_complete_steps()
            count = self.state.updates  # read under the lock: another peer may update next
            self.cond.notify_all()
        if applied and self.on_update is not None:
            self.on_update(self, count)

    def _apply_complete_steps(self) -> bool:
        """Sync: apply every step all live replicas have pushed (caller holds the lock)."""
        applied = False
        while self.mode == "sync":
            step = self.state.clock + 1
            live = [r for r in range(self.replicas) if r not in self.lost]
            # Workers that said goodbye (stopped by a signal, or done) push nothing more.
            expected = {(r, w) for r in live for w in self.workers if (r, w) not in self.done}
            arrived = self.arrived.get(step, set())
            if not expected or not expected <= arrived:
                break
            sums = [g for r, g in self.pending.pop(step, {}).items() if r in live]
            self.arrived.pop(step, None)
            if sums:
                self.rule.apply(0, torch.stack(sums).sum(dim=0) / len(sums))
            self.state.clock = step
            self.state.updates += 1
            applied = True
        return applied

    def _remember(self, replica: int, worker: int, version: int, out: torch.Tensor) -> None:
        """DC-ASGD: keep a copy of what this peer was served (its 4 newest versions)."""
        kept = self.served.setdefault((replica, worker), {})
        kept[version] = out.clone()
        while len(kept) > DC_KEPT:
            kept.pop(min(kept))

    def _served_values(self, replica: int, worker: int, version: int) -> torch.Tensor | None:
        """The values a push's gradient was computed on (DC-ASGD in Downpour), if kept."""
        if not self.dc_lambda or self.mode != "downpour":
            return None
        return self.served.get((replica, worker), {}).get(version)

    def _snapshot_when_ready(self, replica, step, segments) -> tuple[torch.Tensor, int]:
        with self.cond:
            while not self._ready(replica, step):
                self.cond.wait(timeout=0.5)
            parts = [self.rule.values[s.shard_lo : s.shard_lo + s.length] for s in segments]
            # One segment goes out as a view, without a copy: in sync mode nothing changes the
            # values while fetches are served; in Downpour a read racing an update is accepted,
            # as in DistBelief (each value is read whole, either before or after the update).
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            version = self.state.clock if self.mode == "sync" else self.state.updates
        return out, version

    def _ready(self, replica: int, step: int) -> bool:
        if replica in self.lost or step <= 0:
            return True
        if self.mode == "sync":
            return self.state.clock >= step
        # Downpour warm start: wait until replica 0 pushed `step` (or is gone).
        if 0 in self.lost or all((0, w) in self.done for w in self.workers):
            return True
        return all(self.pushed[(0, w)] >= step for w in self.workers)

    def snapshot(self) -> ShardState:
        """A consistent copy of the shard's state (for checkpoints)."""
        with self.cond:
            s = self.state
            return ShardState(
                values=self.rule.values.clone(),
                state=None if self.rule.state is None else self.rule.state.clone(),
                clock=s.clock,
                updates=s.updates,
                progress=dict(s.progress),
            )
