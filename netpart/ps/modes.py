"""What a shard does with pushes and fetches, one object per training mode.

- `Downpour`: each push is folded into the values chunk by chunk as it lands (the update of
  one chunk overlaps the transfer of the next); a fetch is answered at once, or, for a warm
  start (`step` > 0), once replica 0 has pushed that step. With `DelayCompensation` a stale
  push is corrected by the values the pusher was served (DC-ASGD).
- `Sync`: pushes for step t are summed per replica; when every live replica's workers have
  pushed, the mean over replicas is applied once; fetches for step t wait for that. After a
  replica stopped at step t, no step past t is applied.
- `Sandblaster`: pushes are work units' gradients, added once per (unit, worker part) into the
  batch gradient of the L-BFGS vectors; a coordinator drives vector operations on them.

A mode is attached to one `ShardServer` and runs under the server's lock where it says so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from netpart.errors import transport_reason
from netpart.ps.lbfgs import ShardVectors, code_name
from netpart.ps.protocol import (
    HEADER_LEN,
    TAG_HEADER,
    TAG_PAYLOAD,
    Kind,
    Op,
    header,
    overlaps,
    post_chunks,
)
from netpart.ps.rules import DelayCompensation, UpdateRule

if TYPE_CHECKING:
    from netpart.ps.server import ShardServer

__all__ = ["Downpour", "Mode", "Sandblaster", "Sync"]

log = logging.getLogger(__name__)


class Mode:
    """The defaults: pushes folded chunk by chunk into `rule`, fetches always ready."""

    server: ShardServer
    changes_while_served = False  # whether an update may land while a fetch's reply travels
    serves_in_rounds = False  # one thread serves every peer, a request of each per round

    def __init__(self, rule: UpdateRule | None) -> None:
        self.rule = rule

    def attach(self, server: ShardServer) -> None:
        self.server = server
        if self.rule is not None:  # the checkpointed state is the rule's
            assert self.rule.values is server.state.values
            server.state.state = self.rule.state

    def threads(self) -> list[threading.Thread]:
        return []

    def finished(self) -> bool:
        return True

    def ready(self, replica: int, step: int) -> bool:
        return True

    def version(self) -> int:
        """The version a fetch is answered with (and staleness is counted in)."""
        return self.server.state.updates

    def answer_after_push(self, step: int) -> int:
        """A push-and-fetch of `step`: the step its answer waits for (0: none)."""
        return 0

    def current(self, replica: int, worker: int) -> int | None:
        """The version after this peer's last push if no other update came between the values
        it was computed on and it (so the peer's values, with its own pushes applied, are the
        shard's); None if another did, or where the mode does not tell."""
        return None

    def served(self, replica: int, worker: int, version: int, out: torch.Tensor) -> None:
        """A fetch was answered with `out`."""

    def settle(self) -> bool:
        """A peer left or a replica was lost (caller holds the lock); True if it applied."""
        return False

    def receive(self, replica, worker, step, extra, first, payload, segments, src) -> None:
        """A push whose first chunk `first` came with its request: receive the rest into
        `payload` by chunks, folding each as soon as it lands (the update of one chunk
        overlaps the transfer of the next)."""
        then = self._then(replica, worker, extra)
        posted = post_chunks(payload, src)
        self._fold_chunk(replica, step, first, segments, 0, first.numel(), then)
        for (a, b), work in posted:
            work.wait()
            self._fold_chunk(replica, step, payload[a:b], segments, a, b, then)
        self.server.record_push(replica, worker, step, extra)

    def fold(self, replica, worker, step, payload, segments, version: int = -1) -> None:
        """A whole push already in memory: what `receive` does by chunks."""
        then = self._then(replica, worker, version)
        self._fold_chunk(replica, step, payload, segments, 0, payload.numel(), then)
        self.server.record_push(replica, worker, step, version)

    # `_fold_chunk(replica, step, values, segments, a, b, then)`: `values` holds payload[a:b].

    def _then(self, replica: int, worker: int, version: int) -> torch.Tensor | None:
        return None

    def _fold_chunk(self, replica, step, payload, segments, a, b, then) -> None:
        raise NotImplementedError

    def pushed(self, replica: int, worker: int, step: int) -> bool:
        """A push was recorded (caller holds the lock); True if an update was applied."""
        raise NotImplementedError


class Downpour(Mode):
    """Asynchronous: every push is applied on arrival, whole."""

    changes_while_served = True

    def __init__(self, rule: UpdateRule, compensation: DelayCompensation | None = None) -> None:
        super().__init__(rule)
        self.dc = compensation
        self._current: dict[tuple[int, int], int | None] = {}  # peer -> `current`

    def ready(self, replica: int, step: int) -> bool:
        srv = self.server
        if replica in srv.lost or step <= 0:
            return True
        # Warm start: wait until replica 0 pushed `step` (or is gone).
        if 0 in srv.lost or all((0, w) in srv.done for w in srv.workers):
            return True
        return all(srv.pushed[(0, w)] >= step for w in srv.workers)

    def served(self, replica, worker, version, out) -> None:
        if self.dc is not None:
            self.dc.remember((replica, worker), version, out)

    def _then(self, replica, worker, version):
        return None if self.dc is None else self.dc.served_values((replica, worker), version)

    def receive(self, replica, worker, step, extra, first, payload, segments, src) -> None:
        """A push is applied whole and counted, under one hold of the lock, once all its
        chunks are in: no fetch sees part of it, and the update count orders pushes as they
        were applied (`current` is exact)."""
        then = self._then(replica, worker, extra)
        posted = post_chunks(payload, src)
        for _, work in posted:
            work.wait()
        srv = self.server
        with srv.cond:
            if replica in srv.lost:
                return
            alone = 0 <= extra == srv.state.updates  # no update since its values but its own
            self._apply(first, segments, 0, first.numel(), then)
            for (a, b), _ in posted:
                self._apply(payload[a:b], segments, a, b, then)
            applied, count = srv.note_push(replica, worker, step, extra)
            self._current[(replica, worker)] = count if alone else None
        if applied:
            srv.updated(count)

    def current(self, replica, worker) -> int | None:
        return self._current.pop((replica, worker), None)

    def _fold_chunk(self, replica, step, values, segments, a, b, then) -> None:
        with self.server.cond:
            if replica not in self.server.lost:
                self._apply(values, segments, a, b, then)

    def _apply(self, values, segments, a, b, then) -> None:
        for lo, hi, at in overlaps(segments, a, b):
            grad = values[lo - a : hi - a]
            if then is not None:
                now = self.rule.values[at : at + hi - lo]
                grad = self.dc.correct(grad, now, then[lo:hi])
            self.rule.apply(at, grad)

    def pushed(self, replica, worker, step) -> bool:
        self.server.state.updates += 1
        return True


class Sync(Mode):
    """Synchronous: the mean of every live replica's step-t gradients, applied once.

    Each replica's pushes are summed as they land into a buffer of its own for the step (so a
    replica lost mid-step can be left out); the buffers are reused, and the mean is summed
    in place when the step is complete (no allocation, no stacking per step).
    """

    serves_in_rounds = True  # every peer pushes each step and waits for its answer

    def __init__(self, rule: UpdateRule) -> None:
        super().__init__(rule)
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # step -> replica -> sum
        self.arrived: dict[int, set[tuple[int, int]]] = {}
        self._spare: list[torch.Tensor] = []  # buffers of applied steps, for reuse

    def ready(self, replica: int, step: int) -> bool:
        if replica in self.server.lost or step <= 0 or self.server.state.clock >= step:
            return True
        last = self.last_step()
        return last is not None and step > last  # never applied: answered as it stands

    def last_step(self) -> int | None:
        """The last step that may still be applied once a live replica said goodbye (stopped
        by a signal): the lowest step such a replica pushed. A stop so ends on a step every
        replica finished, and a resume from it equals the uninterrupted run."""
        srv = self.server
        ends = [srv.pushed[(r, w)] for r, w in srv.done if r not in srv.lost]
        return min(ends) if ends else None

    def version(self) -> int:
        return self.server.state.clock  # the values of step t-1 stay in place: staleness 0

    def answer_after_push(self, step: int) -> int:
        return step  # the mean of every replica's step t, applied once

    def _fold_chunk(self, replica, step, values, segments, a, b, then) -> None:
        srv = self.server
        with srv.cond:
            if replica in srv.lost:
                return
            pending = self.pending.setdefault(step, {})
            into = pending.get(replica)
            if into is None:
                into = (
                    self._spare.pop() if self._spare else torch.empty(srv.size, dtype=values.dtype)
                )
                pending[replica] = into.zero_()
            for lo, hi, at in overlaps(segments, a, b):
                into[at : at + hi - lo] += values[lo - a : hi - a]

    def pushed(self, replica, worker, step) -> bool:
        self.arrived.setdefault(step, set()).add((replica, worker))
        return self.settle()

    def settle(self) -> bool:
        """Apply every step all live replicas have pushed (caller holds the lock)."""
        srv, applied = self.server, False
        last = self.last_step()
        while True:
            step = srv.state.clock + 1
            if last is not None and step > last:  # a partial step is never applied
                return applied
            live = [r for r in range(srv.replicas) if r not in srv.lost]
            # Workers that said goodbye (stopped by a signal, or done) push nothing more.
            expected = {(r, w) for r in live for w in srv.workers if (r, w) not in srv.done}
            if not expected or not expected <= self.arrived.get(step, set()):
                return applied
            pending = self.pending.pop(step, {})
            self.arrived.pop(step, None)
            sums = [g for r, g in pending.items() if r in live]
            if sums:
                total = sums[0]
                for g in sums[1:]:
                    total += g
                self.rule.apply(0, total.div_(len(sums)))
            self._spare.extend(pending.values())
            srv.state.clock = step
            srv.state.updates += 1
            applied = True


class Sandblaster(Mode):
    """L-BFGS vectors in the shard: pushes are work units' gradients; a coordinator sends
    vector operations (one float64 back per operation).

    `WAIT` never waits for ever: it answers 0 once every part arrived, or the number of parts
    still missing when a replica was lost since `BEGIN` and none arrived for `LOSS_GRACE`
    seconds (a part the dead replica owed), or none arrived for `timeout` seconds; the
    coordinator then evaluates again."""

    LOSS_GRACE = 1.0

    def __init__(self, vectors: ShardVectors, coordinator: int, timeout: float = 60.0) -> None:
        super().__init__(None)
        self.vectors, self.coordinator, self.timeout = vectors, coordinator, timeout
        self.coordinator_done = False
        self.eval_id = -1
        self.lost_at_begin = 0
        self.units_in: dict[int, set[int]] = {}
        self.duplicates = 0  # backup copies of units that arrived second (dropped)

    def attach(self, server: ShardServer) -> None:
        super().attach(server)
        self.units_in = {w: set() for w in server.workers}

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._commands, daemon=True, name="commands")]

    def finished(self) -> bool:
        return self.coordinator_done

    def receive(self, replica, worker, step, extra, first, payload, segments, src) -> None:
        """Add a unit's gradient into the batch gradient, once per (unit, worker) part."""
        posted = post_chunks(payload, src)
        payload[: first.numel()].copy_(first)
        for _, work in posted:
            work.wait()
        self.fold(replica, worker, step, payload, segments, extra)

    def fold(self, replica, worker, step, payload, segments, version: int = -1) -> None:
        unit, eval_id = step, version
        with self.server.cond:
            if eval_id != self.eval_id or unit in self.units_in[worker]:
                self.duplicates += 1  # a backup that lost, or a unit of an older evaluation
                return
            self.units_in[worker].add(unit)
            g = self.vectors.vectors["g"]
            for lo, hi, at in overlaps(segments, 0, payload.numel()):
                g[at : at + hi - lo] += payload[lo:hi]
            self.server.cond.notify_all()

    def _commands(self) -> None:
        """Serve the coordinator's vector operations; each gets a one-value reply."""
        srv, src = self.server, self.coordinator
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        args = torch.empty(4, dtype=torch.float64)
        try:
            while True:
                dist.recv(head, src=src, tag=TAG_HEADER)
                op = Op(int(head[3]))
                dist.recv(args, src=src, tag=TAG_PAYLOAD)
                value = self.command(op, *args.tolist())
                if op == Op.WAIT and value == 0:  # an evaluation is complete
                    srv.updated(srv.state.updates)
                reply = header(Kind.REPLY, srv.rank, srv.shard, int(op), 1, 0)
                dist.send(reply, dst=src, tag=TAG_HEADER)
                dist.send(torch.tensor([value], dtype=torch.float64), dst=src, tag=TAG_PAYLOAD)
                if op == Op.STOP:
                    break
        except RuntimeError as exc:
            log.warning("shard %d: coordinator lost (%s)", srv.shard, transport_reason(exc))
        with srv.cond:
            self.coordinator_done = True
            srv.cond.notify_all()
        srv.may_end()

    def command(self, op: Op, alpha: float, a: float, b: float, c: float) -> float:
        """Run one coordinator operation on this shard's vectors (names come as codes)."""
        v, srv = self.vectors, self.server
        na, nb, nc = (code_name(int(x)) for x in (a, b, c))
        with srv.cond:
            if op == Op.WAIT:
                return self._wait(int(alpha))
            if op == Op.BEGIN:
                self.eval_id = int(alpha)
                self.lost_at_begin = len(srv.lost)
                self.units_in = {w: set() for w in srv.workers}
                v.vectors["g"].zero_()
                return 0.0
            return v.run(op.name.lower(), alpha, na, nb, nc)

    def _wait(self, units: int) -> float:
        """Under the lock: 0.0 once every worker's part of `units` units is in (an update),
        else the number of parts missing once waiting is pointless (see the class)."""
        srv = self.server

        def missing() -> int:
            return sum(max(0, units - len(self.units_in[w])) for w in srv.workers)

        seen, since = missing(), time.monotonic()
        while seen:
            srv.cond.wait(timeout=0.2)
            now, left = time.monotonic(), missing()
            if left != seen:
                seen, since = left, now
            lost = len(srv.lost) > self.lost_at_begin
            if seen and now - since > (self.LOSS_GRACE if lost else self.timeout):
                log.warning("shard %d: evaluation %d misses %d unit parts", srv.shard,
                            self.eval_id, seen)  # fmt: skip
                return float(seen)
        srv.state.updates += 1
        return 0.0
