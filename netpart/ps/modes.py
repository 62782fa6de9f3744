"""What a shard does with what arrives, one policy object per training mode.

The shard server (`netpart.ps.server`) owns its lock, its links and its bookkeeping; it hands
a mode what arrived, under its lock, with a read-only view of that bookkeeping (`ShardView`),
and the mode answers with a `Response`: gradients for the shard's update rule to apply, how
many updates that completes, the step now applied (sync), or a command's value. A mode never
touches the server (ps-lite's `ReqHandle(meta, data, server)` answering through `Response`).

- `Downpour`: each push is applied whole when it is in; a fetch is answered at once, or, for
  a warm start (`step` > 0), once replica 0 has pushed that step. With `DelayCompensation` a
  stale push is corrected by the values the pusher was served (DC-ASGD).
- `Sync`: pushes for step t are summed per replica as their chunks land; when every live
  replica's workers have pushed, the mean over replicas is applied once; fetches for step t
  wait for that. After a replica stopped at step t, no step past t is applied.
- `Sandblaster`: pushes are work units' gradients, added once per (unit, worker part) into
  the batch gradient of the L-BFGS vectors it holds; a coordinator's commands run vector
  operations on them (`command`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from netpart.compile.shards import Segment
from netpart.ps.lbfgs_vectors import ShardVectors, code_name
from netpart.ps.protocol import Op, overlaps
from netpart.ps.rules import DelayCompensation

__all__ = ["Chunks", "Downpour", "Mode", "Push", "Response", "Sandblaster", "ShardView", "Sync"]

log = logging.getLogger(__name__)


class ShardView(Protocol):
    """What a mode may read of the shard's bookkeeping (the server keeps it; read only)."""

    shard: int
    replicas: int
    workers: tuple[int, ...]  # the model workers (of every replica) this shard serves
    size: int  # values the shard holds
    values: torch.Tensor  # the shard's values
    lost: Mapping[int, str]  # replica -> why it was lost
    done: Collection[tuple[int, int]]  # (replica, worker) that said goodbye
    pushed: Mapping[tuple[int, int], int]  # (replica, worker) -> last step pushed
    clock: int  # sync: the last step applied
    updates: int  # updates applied so far


Chunks = list[tuple[int, torch.Tensor]]  # a push's values: (offset in its payload, values)


@dataclass(frozen=True)
class Push:
    """A push's header: who sent it, its step (Sandblaster: the unit), the shard version its
    gradient was computed on (Sandblaster: the evaluation; -1: none), and where its values
    land in the shard."""

    replica: int
    worker: int
    step: int
    version: int
    segments: tuple[Segment, ...]


@dataclass
class Response:
    """What a mode asks of the shard: apply each (shard offset, gradient) with the update
    rule, in order; count `updates` more updates; set the applied step (`clock`, sync); a
    command's answer (`value`; None: not yet, ask again once something arrives)."""

    apply: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    updates: int = 0
    clock: int | None = None
    value: float | None = None


def _pieces(push: Push, chunks: Chunks):
    """(payload lo, hi, shard offset, values) of every part of the push's chunks that lands
    in one of its segments."""
    for start, values in chunks:
        for lo, hi, at in overlaps(push.segments, start, start + values.numel()):
            yield lo, hi, at, values[lo - start : hi - start]


class Mode:
    """The defaults: a push is handed over whole once it is in, fetches are always ready."""

    changes_while_served = False  # whether an update may land while a fetch's reply travels
    serves_in_rounds = False  # one thread serves every peer, a request of each per round
    folds_chunks = False  # a push's chunks are handed over as they land (`fold`)
    records_pushes = True  # a push moves its replica's progress and counts its staleness
    keeps_lost_pushes = False  # a push from a replica already lost still counts
    commands = False  # a coordinator sends vector operations (`command`)

    def version(self, view: ShardView) -> int:
        """The version a fetch is answered with (and staleness is counted in)."""
        return view.updates

    def ready(self, view: ShardView, replica: int, step: int) -> bool:
        """Whether a fetch of `replica` that waits for `step` may be answered now."""
        return True

    def answer_after_push(self, step: int) -> int:
        """A push-and-fetch of `step`: the step its answer waits for (0: none)."""
        return 0

    def fold(self, view: ShardView, push: Push, values: torch.Tensor, lo: int, hi: int) -> None:
        """Values [lo, hi) of a push's payload landed (`folds_chunks` modes only)."""

    def pushed(self, view: ShardView, push: Push, chunks: Chunks | None) -> Response:
        """A push is in (`chunks`: its values; None where `fold` took them) and recorded."""
        raise NotImplementedError

    def settle(self, view: ShardView) -> Response:
        """A peer said goodbye or a replica was lost."""
        return Response()

    def served(self, replica: int, worker: int, version: int, values: torch.Tensor) -> None:
        """A fetch was answered with `values` at `version`."""

    def current(self, replica: int, worker: int) -> int | None:
        """The version after this peer's last push if no other update came between the values
        it was computed on and it (so the peer's values, with its own pushes applied, are the
        shard's); None if another did, or where the mode does not tell. Told once."""
        return None

    def command(self, view: ShardView, op: Op, args: tuple[float, ...], now: float) -> Response:
        """A coordinator's operation (`commands` modes only)."""
        raise NotImplementedError


class Downpour(Mode):
    """Asynchronous: every push is applied on arrival, whole."""

    changes_while_served = True

    def __init__(self, compensation: DelayCompensation | None = None) -> None:
        self.dc = compensation
        self._current: dict[tuple[int, int], int | None] = {}  # peer -> `current`

    def ready(self, view: ShardView, replica: int, step: int) -> bool:
        if replica in view.lost or step <= 0:
            return True
        # Warm start: wait until replica 0 pushed `step` (or is gone).
        if 0 in view.lost or all((0, w) in view.done for w in view.workers):
            return True
        return all(view.pushed[(0, w)] >= step for w in view.workers)

    def pushed(self, view: ShardView, push: Push, chunks: Chunks | None) -> Response:
        """The push whole, as one update: no fetch sees part of it, and the update count
        orders pushes as they were applied (`current` is exact)."""
        peer = (push.replica, push.worker)
        then = None if self.dc is None else self.dc.served_values(peer, push.version)
        apply = []
        for lo, hi, at, grad in _pieces(push, chunks):
            if then is not None:
                grad = self.dc.correct(grad, view.values[at : at + hi - lo], then[lo:hi])
            apply.append((at, grad))
        alone = 0 <= push.version == view.updates  # no update since its values but its own
        self._current[peer] = view.updates + 1 if alone else None
        return Response(apply=apply, updates=1)

    def served(self, replica, worker, version, values) -> None:
        if self.dc is not None:
            self.dc.remember((replica, worker), version, values)

    def current(self, replica, worker) -> int | None:
        return self._current.pop((replica, worker), None)


class Sync(Mode):
    """Synchronous: the mean of every live replica's step-t gradients, applied once.

    Each replica's pushes are summed as they land into a buffer of its own for the step (so a
    replica lost mid-step can be left out); the buffers are reused, and the mean is summed
    in place when the step is complete (no allocation, no stacking per step).
    """

    serves_in_rounds = True  # every peer pushes each step and waits for its answer
    folds_chunks = True

    def __init__(self) -> None:
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # step -> replica -> sum
        self.arrived: dict[int, set[tuple[int, int]]] = {}
        self._spare: list[torch.Tensor] = []  # buffers of applied steps, for reuse

    def version(self, view: ShardView) -> int:
        return view.clock  # the values of step t-1 stay in place: staleness 0

    def ready(self, view: ShardView, replica: int, step: int) -> bool:
        if replica in view.lost or step <= 0 or view.clock >= step:
            return True
        last = self.last_step(view)
        return last is not None and step > last  # never applied: answered as it stands

    def last_step(self, view: ShardView) -> int | None:
        """The last step that may still be applied once a live replica said goodbye (stopped
        by a signal): the lowest step such a replica pushed. A stop so ends on a step every
        replica finished, and a resume from it equals the uninterrupted run."""
        ends = [view.pushed[peer] for peer in view.done if peer[0] not in view.lost]
        return min(ends) if ends else None

    def answer_after_push(self, step: int) -> int:
        return step  # the mean of every replica's step t, applied once

    def fold(self, view: ShardView, push: Push, values: torch.Tensor, lo: int, hi: int) -> None:
        pending = self.pending.setdefault(push.step, {})
        into = pending.get(push.replica)
        if into is None:
            into = self._spare.pop() if self._spare else torch.empty(view.size, dtype=values.dtype)
            pending[push.replica] = into.zero_()
        for a, b, at in overlaps(push.segments, lo, hi):
            into[at : at + b - a] += values[a - lo : b - lo]

    def pushed(self, view: ShardView, push: Push, chunks: Chunks | None) -> Response:
        self.arrived.setdefault(push.step, set()).add((push.replica, push.worker))
        return self.settle(view)

    def settle(self, view: ShardView) -> Response:
        """Every step all live replicas have pushed, their means in order."""
        out = Response()
        last = self.last_step(view)
        live = [r for r in range(view.replicas) if r not in view.lost]
        # Workers that said goodbye (stopped by a signal, or done) push nothing more.
        expected = {(r, w) for r in live for w in view.workers if (r, w) not in view.done}
        step = view.clock + 1
        while last is None or step <= last:  # a partial step is never applied
            if not expected or not expected <= self.arrived.get(step, set()):
                break
            pending = self.pending.pop(step, {})
            self.arrived.pop(step, None)
            sums = [g for r, g in pending.items() if r in live]
            if sums:
                total = sums[0]
                for g in sums[1:]:
                    total += g
                out.apply.append((0, total.div_(len(sums))))
            self._spare.extend(pending.values())  # reused only after the server applied
            out.clock, out.updates, step = step, out.updates + 1, step + 1
        return out


class Sandblaster(Mode):
    """L-BFGS vectors in the shard: pushes are work units' gradients; a coordinator sends
    vector operations (one float back per operation).

    `WAIT` never waits for ever: it answers 0 once every part arrived, or the number of parts
    still missing when a replica was lost since `BEGIN` and none arrived for `LOSS_GRACE`
    seconds (a part the dead replica owed), or none arrived for `timeout` seconds; the
    coordinator then evaluates again."""

    LOSS_GRACE = 1.0
    records_pushes = False  # a push is a work unit: progress and staleness mean nothing here
    keeps_lost_pushes = True  # a unit's gradient is the unit's, whoever computed it
    commands = True

    def __init__(self, vectors: ShardVectors, workers: tuple[int, ...], timeout: float = 60.0):
        self.vectors, self.timeout = vectors, timeout
        self.eval_id = -1
        self.lost_at_begin = 0
        self.units_in: dict[int, set[int]] = {w: set() for w in workers}
        self.duplicates = 0  # backup copies of units that arrived second (dropped)
        self._waiting: tuple[int, float] | None = None  # a WAIT's parts missing, since when

    def pushed(self, view: ShardView, push: Push, chunks: Chunks | None) -> Response:
        """Add a unit's gradient into the batch gradient, once per (unit, worker) part."""
        unit, eval_id = push.step, push.version
        if eval_id != self.eval_id or unit in self.units_in[push.worker]:
            self.duplicates += 1  # a backup that lost, or a unit of an older evaluation
            return Response()
        self.units_in[push.worker].add(unit)
        g = self.vectors.vectors["g"]
        for lo, hi, at, grad in _pieces(push, chunks):
            g[at : at + hi - lo] += grad
        return Response()

    def command(self, view: ShardView, op: Op, args: tuple[float, ...], now: float) -> Response:
        """Run one coordinator operation on this shard's vectors (names come as codes)."""
        alpha, *codes = args
        if op == Op.WAIT:
            return self._wait(view, int(alpha), now)
        if op == Op.BEGIN:
            self.eval_id = int(alpha)
            self.lost_at_begin = len(view.lost)
            self.units_in = {w: set() for w in view.workers}
            self.vectors.vectors["g"].zero_()
            return Response(value=0.0)
        if op == Op.STOP:
            return Response(value=0.0)
        names = (code_name(int(x)) for x in codes)
        return Response(value=self.vectors.run(op.name.lower(), alpha, *names))

    def _wait(self, view: ShardView, units: int, now: float) -> Response:
        """0.0 once every worker's part of `units` units is in (an update), else None (ask
        again) until waiting is pointless: then the number of parts missing."""
        missing = sum(max(0, units - len(self.units_in[w])) for w in view.workers)
        if not missing:
            self._waiting = None
            return Response(updates=1, value=0.0)
        seen, since = self._waiting or (missing, now)
        if missing != seen:
            seen, since = missing, now
        lost = len(view.lost) > self.lost_at_begin
        if now - since > (self.LOSS_GRACE if lost else self.timeout):
            self._waiting = None
            log.warning(
                "shard %d: evaluation %d misses %d unit parts", view.shard, self.eval_id, missing
            )
            return Response(value=float(missing))
        self._waiting = (seen, since)
        return Response()
