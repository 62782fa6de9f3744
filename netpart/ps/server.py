"""ShardServer: one parameter-server shard serving every replica's workers that hold its range.

Each (replica, worker) peer is served from its own thread (gloo isolates pairs: a dead peer
fails only its own thread); in sync mode, where every peer pushes each step and waits for its
answer, one thread serves them all a round at a time (no hand-off between threads lies
between the last push of a step and the replies). The server checks every header against the
layout, counts bytes, answers fetches and keeps the bookkeeping every mode shares — how far
each replica pushed, the staleness of every push, which peers said goodbye and which replicas
were lost — under one lock. What a push *does* is the mode's (`netpart.ps.modes`: Downpour,
Sync, Sandblaster).

A peer whose connection fails marks its whole replica lost: the shard keeps serving the rest.
Staleness of a push = updates the shard applied between serving the values the gradient was
computed on and applying it (0 in sync mode); the shard keeps a histogram of it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from netpart.errors import ProtocolError, RuntimeFailure, transport_reason, write_reason
from netpart.partition.shards import Segment, ShardLayout
from netpart.ps.modes import Mode
from netpart.ps.protocol import (
    CHUNK,
    TAG_HEADER,
    TAG_PAYLOAD,
    Kind,
    combined_reply,
    header,
    read_header,
    request_buffer,
    segments_length,
    values_of,
    write_header,
)

__all__ = ["ShardServer", "ShardSetup", "ShardState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSetup:
    """Where a shard sits in its job: which range it holds and whom it serves."""

    layout: ShardLayout
    shard: int
    replicas: int
    rank: int  # this shard's global rank
    rank_of: Callable[[int, int], int]  # (replica, worker) -> global rank


@dataclass
class ShardState:
    """What a shard checkpoints: values, optimizer state, and how far each replica got."""

    values: torch.Tensor
    state: torch.Tensor | None
    clock: int = 0  # sync: last step applied
    updates: int = 0  # updates applied (pushes in downpour, steps in sync, evaluations)
    progress: dict[int, int] = field(default_factory=dict)  # replica -> last step pushed


@dataclass(eq=False)  # a peer is itself: compared and hashed by identity
class _Link:
    """One peer's buffers: its requests land in `request`, a push's later chunks in
    `payload`; `reply` holds [header | values] when they fit one chunk."""

    replica: int
    worker: int
    src: int
    segments: tuple[Segment, ...]
    request: torch.Tensor
    payload: torch.Tensor
    reply: torch.Tensor | None


class ShardServer:
    """Shard `setup.shard` of the layout; `mode` decides what pushes and fetches do."""

    def __init__(
        self,
        setup: ShardSetup,
        state: ShardState,
        mode: Mode,
        on_update: Callable[[ShardServer, int], None] | None = None,
    ) -> None:
        self.setup, self.state, self.mode, self.on_update = setup, state, mode, on_update
        self.shard, self.replicas, self.rank = setup.shard, setup.replicas, setup.rank
        layout = setup.layout
        self.workers = layout.peers(self.shard)
        self.routes = {w: layout.routes(w)[self.shard] for w in self.workers}
        self.size = int(layout.shard_sizes()[self.shard])
        self.cond = threading.Condition()  # the lock of all bookkeeping; fetches wait on it
        self._ending = threading.Event()  # something that may end serving happened
        self.lost: dict[int, str] = {}  # replica -> why
        self.done: set[tuple[int, int]] = set()
        self.pushed = {
            (r, w): state.progress.get(r, 0) for r in range(self.replicas) for w in self.workers
        }
        self.bytes_in = 0
        self.bytes_out = 0
        self.staleness: collections.Counter[int] = collections.Counter()
        self.last_staleness: dict[tuple[int, int], int] = {}
        self.fatal: str | None = None  # why this shard cannot go on (a checkpoint not written)
        mode.attach(self)

    # ---- serving -------------------------------------------------------------------------
    def serve(self, stop: threading.Event | None = None, grace: float = 60.0) -> None:
        """Serve until every peer said goodbye or was lost (or `grace` s after `stop` is set)."""
        if self.mode.serves_in_rounds:
            threads = [threading.Thread(target=self._rounds, daemon=True, name="peers")]
        else:
            threads = [
                threading.Thread(target=self._peer, args=(r, w), daemon=True, name=f"peer-{r}-{w}")
                for r in range(self.replicas)
                for w in self.workers
            ]
        threads += self.mode.threads()
        for t in threads:
            t.start()
        deadline = None
        while True:
            self._ending.clear()  # before looking: what happens after wakes the wait below
            with self.cond:
                if self.fatal is not None:
                    raise RuntimeFailure(f"shard {self.shard}: {self.fatal}")
                if self._finished():
                    break
            if stop is not None and stop.is_set() and deadline is None:
                log.info("shard %d: stopping; waiting %.0f s for workers", self.shard, grace)
                deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                log.warning("shard %d: workers did not finish in time", self.shard)
                break
            self._ending.wait(timeout=0.2)  # not woken by every push: only by what may end

    def may_end(self) -> None:
        """A peer said goodbye, a replica was lost or a mode's own thread ended: `serve`
        looks again whether it is done."""
        self._ending.set()

    def _finished(self) -> bool:
        return self.mode.finished() and all(
            (r, w) in self.done or r in self.lost
            for r in range(self.replicas)
            for w in self.workers
        )

    def _link(self, replica: int, worker: int) -> _Link:
        n = segments_length(self.routes[worker])
        dtype = self.state.values.dtype
        return _Link(
            replica, worker, self.setup.rank_of(replica, worker), self.routes[worker],
            request_buffer(n, dtype), torch.empty(n, dtype=dtype),
            request_buffer(n, dtype) if combined_reply(n) else None,
        )  # fmt: skip

    def _peer(self, replica: int, worker: int) -> None:
        """Serve one peer from its own thread until it says goodbye or is lost."""
        link = self._link(replica, worker)
        pg = dist.group.WORLD  # on the group itself: no wrapper per message
        try:
            while True:
                pg.recv([link.request], link.src, TAG_HEADER).wait()
                if self._answer(link, *self._take(link)):
                    return
        except (RuntimeError, ProtocolError) as exc:
            self._drop(link, exc)
        except OSError as exc:  # an update hook's write failed (disk full, read-only): fatal
            self.fail(write_reason(exc))

    def _rounds(self) -> None:
        """Serve every peer from one thread, a round at a time (sync): receive one request
        from each peer not waiting for an answer, then answer every waiting peer whose step is
        applied. Each sends one request per step and waits for its answer, so once a round is
        in, the step is complete, and no hand-off between threads lies between the last push
        and the replies. Peers that wait for a step no peer left can complete fail the shard
        in one line instead of waiting for ever."""
        links = [self._link(r, w) for r in range(self.replicas) for w in self.workers]
        pg, waiting = dist.group.WORLD, []
        try:
            while links:
                busy = {x[0] for x in waiting}
                posted = []
                for link in [x for x in links if x not in busy]:
                    try:
                        posted.append((link, pg.recv([link.request], link.src, TAG_HEADER)))
                    except RuntimeError as exc:
                        self._drop(link, exc, links)
                for link, work in posted:
                    try:
                        work.wait()
                        waiting.append((link, *self._take(link)))
                    except (RuntimeError, ProtocolError) as exc:
                        self._drop(link, exc, links)
                waiting = self._answer_ready(waiting, links)
                if waiting and len(waiting) == len(links):
                    link, _, step, _ = waiting[0]
                    self.fail(f"replica {link.replica} waits for step {step}, which no peer "
                              "left can complete")  # fmt: skip
                    return
        except OSError as exc:  # an update hook's write failed (disk full, read-only): fatal
            self.fail(write_reason(exc))

    def _answer_ready(self, waiting: list, links: list) -> list:
        """Answer the waiting (link, kind, step, extra) whose answer is ready, again while one
        more became ready (a goodbye can make another's step answerable); those left."""
        while True:
            left = []
            for item in waiting:
                link, kind, step, _ = item
                with self.cond:
                    ready = self.mode.ready(link.replica, self._waits_for(kind, step))
                if not ready:
                    left.append(item)
                    continue
                try:
                    if self._answer(link, *item[1:]):
                        links.remove(link)
                except (RuntimeError, ProtocolError) as exc:
                    self._drop(link, exc, links)
            if len(left) == len(waiting):
                return left
            waiting = left

    def _take(self, link: _Link) -> tuple[int, int, int]:
        """A request received in `link.request`: check its header and take in its push (the
        later chunks included, folded as they land); (kind, step, extra)."""
        replica, worker, src, n = link.replica, link.worker, link.src, link.payload.numel()
        kind, sender, shard, step, length, rep, extra = read_header(link.request)
        if (sender, shard, rep) != (src, self.shard, replica):
            raise ProtocolError(
                f"shard {self.shard}: header from rank {src} says sender {sender}, "
                f"shard {shard}, replica {rep}"
            )
        if kind in (Kind.PUSH, Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL):
            if length != n:
                raise ProtocolError(
                    f"shard {self.shard}: push of {length} values from replica "
                    f"{replica} worker {worker}, the layout says {n}"
                )
            first = values_of(link.request, link.payload.dtype, min(n, CHUNK))
            self.mode.receive(replica, worker, step, extra, first, link.payload, link.segments, src)
            self._count(bytes_in=n * link.payload.element_size())
        return kind, step, extra

    def _answer(self, link: _Link, kind: int, step: int, extra: int) -> bool:
        """Answer a taken request as its kind says; True after a goodbye."""
        replica, worker, src, reply = link.replica, link.worker, link.src, link.reply
        current = self.mode.current(replica, worker) if kind == Kind.PUSH_FETCH_LOCAL else None
        if current is not None:
            self._reply_current(replica, current, src, reply is not None)
        elif kind in (Kind.FETCH, Kind.FETCH_LOCAL):
            held = extra if kind == Kind.FETCH_LOCAL else -1
            self._reply(replica, worker, self._waits_for(kind, step), src, reply, held)
        elif kind in (Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL):
            self._reply(replica, worker, self._waits_for(kind, step), src, reply)
        elif kind == Kind.BYE:
            self._goodbye(replica, worker)
            return True
        elif kind != Kind.PUSH:
            raise ProtocolError(f"shard {self.shard}: unknown message kind {kind}")
        return False

    def _waits_for(self, kind: int, step: int) -> int:
        """The step a request's answer waits for: a fetch's own, a push-and-fetch's as the
        mode says, none (0) for a push alone or a goodbye."""
        if kind in (Kind.FETCH, Kind.FETCH_LOCAL):
            return step
        if kind in (Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL):
            return self.mode.answer_after_push(step)
        return 0

    def _drop(self, link: _Link, exc: Exception, links: list | None = None) -> None:
        """A peer's connection failed or it broke the protocol: its replica is lost."""
        reason = str(exc) if isinstance(exc, ProtocolError) else transport_reason(exc)
        self.lose(link.replica, f"worker {link.worker}: {reason}")
        if links is not None and link in links:
            links.remove(link)

    def fail(self, why: str) -> None:
        """This shard cannot go on: `serve` raises RuntimeFailure(why) instead of waiting."""
        with self.cond:
            self.fatal = self.fatal or why
        self.may_end()

    def _reply(self, replica: int, worker: int, upto: int, dst: int, reply, held=-1) -> None:
        """Answer a fetch (once step `upto` is applied): one message [header | values] when
        they fit one chunk, else a header and the values. The values are copied under the
        lock where the mode may change them while the reply travels (Downpour), so a reply
        always shows whole updates. If the shard is still at version `held` (>= 0: the
        version a worker with local steps holds), the answer is CURRENT."""
        n = segments_length(self.routes[worker])
        snapshot = values_of(reply, self.state.values.dtype, n) if reply is not None else None
        if snapshot is None and self.mode.changes_while_served:  # freed once sent
            snapshot = torch.empty(n, dtype=self.state.values.dtype)
        out, version, stale = self.answer_fetch(replica, worker, upto, snapshot, held)
        if out is None:
            self._reply_current(replica, version, dst, reply is not None, stale)
            return
        head = (int(Kind.PARAMS), self.rank, self.shard, version, out.numel(), replica, stale)
        if reply is not None:
            write_header(reply, *head)
            dist.group.WORLD.send([reply], dst, TAG_HEADER).wait()
        else:
            dist.send(torch.tensor(head, dtype=torch.int64), dst=dst, tag=TAG_HEADER)
            dist.send(out, dst=dst, tag=TAG_PAYLOAD)
        self._count(bytes_out=out.numel() * out.element_size())

    def _reply_current(
        self, replica: int, version: int, dst: int, combined: bool, stale: int = 0
    ) -> None:
        """Answer a fetch from a worker whose values are the shard's (a PUSH_FETCH_LOCAL whose
        push was the only update since the values it was computed on, or a FETCH_LOCAL at the
        version it holds): a CURRENT header with that version (and an empty payload message
        where the worker expects the values apart); `stale`: of the peer's last push."""
        head = header(Kind.CURRENT, self.rank, self.shard, version, 0, replica, stale)
        pg = dist.group.WORLD
        pg.send([head], dst, TAG_HEADER).wait()
        if not combined:
            pg.send([head[:0]], dst, TAG_PAYLOAD).wait()

    def _count(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self.cond:  # peers run in threads: count under the lock
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def _goodbye(self, replica: int, worker: int) -> None:
        with self.cond:
            self.done.add((replica, worker))
            applied = self.mode.settle()  # sync: stop waiting for it
            count = self.state.updates
            self.cond.notify_all()
        self.may_end()
        if applied:
            self.updated(count)

    # ---- what the modes share ---------------------------------------------------------------
    def answer_fetch(
        self,
        replica: int,
        worker: int,
        step: int,
        into: torch.Tensor | None = None,
        held: int = -1,
    ) -> tuple[torch.Tensor | None, int, int]:
        """(values, version, staleness of this peer's last push) for a fetch, once the mode
        says the values are ready for `step`. With `into`, the values are copied there under
        the lock (a snapshot no update tears); without, one segment is returned as a view.
        No values (None) if the version is `held`: the peer holds these values."""
        segments = self.routes[worker]
        with self.cond:
            while not self.mode.ready(replica, step):
                self.cond.wait(timeout=0.5)
            if held >= 0 and self.mode.version() == held:
                return None, held, self.last_staleness.get((replica, worker), -1)
            values = self.state.values
            parts = [values[s.shard_lo : s.shard_lo + s.length] for s in segments]
            if into is not None and len(parts) > 1:
                out = torch.cat(parts, out=into)
            elif into is not None:
                out = into.copy_(parts[0])
            else:
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
            version = self.mode.version()
            stale = self.last_staleness.get((replica, worker), -1)
        self.mode.served(replica, worker, version, out)
        return out, version, stale

    def fold(
        self,
        replica: int,
        worker: int,
        step: int,
        payload: torch.Tensor,
        segments: tuple[Segment, ...],
        version: int = -1,
    ) -> None:
        """Apply a whole push that is already in memory (what a received push does by chunks)."""
        self.mode.fold(replica, worker, step, payload, segments, version)

    def record_push(self, replica: int, worker: int, step: int, version: int) -> None:
        """A push is in: note how far the replica got and its staleness; let the mode apply."""
        with self.cond:
            applied, count = self.note_push(replica, worker, step, version)
        if applied:
            self.updated(count)

    def note_push(self, replica: int, worker: int, step: int, version: int) -> tuple[bool, int]:
        """`record_push` under a hold of the lock the caller already has (a mode that applies
        a push and counts it in one hold): (whether an update was applied, the update count);
        the caller then calls `updated(count)` outside the lock if one was."""
        if replica in self.lost:
            return False, self.state.updates
        self.pushed[(replica, worker)] = step
        self.state.progress[replica] = min(self.pushed[(replica, w)] for w in self.workers)
        if version >= 0:
            stale = max(0, self.mode.version() - version)
            self.staleness[stale] += 1
            self.last_staleness[(replica, worker)] = stale
        applied = self.mode.pushed(replica, worker, step)
        self.cond.notify_all()
        return applied, self.state.updates  # read under the lock: another peer may update next

    def updated(self, count: int) -> None:
        """Called (outside the lock) after update number `count`: checkpoints hook in here."""
        if self.on_update is not None:
            self.on_update(self, count)

    def lose(self, replica: int, why: str) -> None:
        """Stop waiting for `replica`: its pushes in flight are dropped, its fetches answered."""
        with self.cond:
            if replica not in self.lost:
                log.warning("shard %d: replica %d lost (%s)", self.shard, replica, why)
                self.lost[replica] = why
                self.mode.settle()
            self.cond.notify_all()
        self.may_end()

    def snapshot(self) -> ShardState:
        """A consistent copy of the shard's state (for checkpoints)."""
        with self.cond:
            s = self.state
            return ShardState(
                values=s.values.clone(),
                state=None if s.state is None else s.state.clone(),
                clock=s.clock,
                updates=s.updates,
                progress=dict(s.progress),
            )
