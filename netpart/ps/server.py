"""ShardServer: one parameter-server shard serving every replica's workers that hold its range.

The server owns the shard's values and update rule, its links to its peers, its bookkeeping
and the one lock over all of them. Each (replica, worker) peer is served from its own thread
(gloo isolates pairs: a dead peer fails only its own thread); in sync mode, where every peer
pushes each step and waits for its answer, one thread serves them all a round at a time (no
hand-off between threads lies between the last push of a step and the replies); Sandblaster's
coordinator has a thread of its own. The server checks every header against the layout,
receives pushes, counts bytes and answers fetches. What a push *does* is its mode's
(`netpart.ps.modes`): the server hands it what arrived with a read-only view of the
bookkeeping, and applies the `Response` it returns.

A peer whose connection fails marks its whole replica lost: the shard keeps serving the rest.
Staleness of a push = updates the shard applied between serving the values the gradient was
computed on and applying it (0 in sync mode); the shard keeps a histogram of it. Whoever
checkpoints the shard waits for updates (`wait_update`) and copies a consistent state
(`snapshot`); nothing here calls back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist

from netpart.compile.shards import Segment, ShardLayout
from netpart.errors import ProtocolError, RuntimeFailure, transport_reason
from netpart.ps.modes import Mode, Push, Response
from netpart.ps.protocol import (
    CHUNK,
    DIVERGED,
    TAG_HEADER,
    TAG_PAYLOAD,
    Kind,
    Op,
    combined_reply,
    header,
    post_chunks,
    read_header,
    request_buffer,
    segments_length,
    values_of,
    write_header,
)
from netpart.ps.rules import UpdateRule
from netpart.ps.serving import serving_threads

__all__ = ["Link", "ShardServer", "ShardSetup", "ShardState"]

log = logging.getLogger(__name__)

PUSHES = (Kind.PUSH, Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL)


@dataclass(frozen=True)
class ShardSetup:
    """Where a shard sits in its job: which range it holds and whom it serves."""

    layout: ShardLayout
    shard: int
    replicas: int
    rank: int  # this shard's global rank
    rank_of: Callable[[int, int], int]  # (replica, worker) -> global rank
    coordinator: int = -1  # Sandblaster: the coordinator's global rank


@dataclass
class ShardState:
    """What a shard checkpoints: values, optimizer state, and how far each replica got."""

    values: torch.Tensor
    state: torch.Tensor | None
    clock: int = 0  # sync: last step applied
    updates: int = 0  # updates applied (pushes in downpour, steps in sync, evaluations)
    progress: dict[int, int] = field(default_factory=dict)  # replica -> last step pushed


@dataclass(eq=False)  # a peer is itself: compared and hashed by identity
class Link:
    """One peer's buffers: its requests land in `request`, a push's later chunks in
    `payload`; `reply` holds [header | values] when they fit one chunk."""

    replica: int
    worker: int
    src: int
    segments: tuple[Segment, ...]
    request: torch.Tensor
    payload: torch.Tensor
    reply: torch.Tensor | None


class _View:
    """What the server's mode reads (`netpart.ps.modes.ShardView`): live, read-only views of
    the server's bookkeeping."""

    def __init__(self, server: ShardServer) -> None:
        self.shard, self.replicas, self.size = server.shard, server.replicas, server.size
        self.workers = tuple(server.workers)
        self.values = server.state.values
        self.lost = MappingProxyType(server.lost)
        self.done = server.done.keys()
        self.pushed = MappingProxyType(server.pushed)
        self._state = server.state

    @property
    def clock(self) -> int:
        return self._state.clock

    @property
    def updates(self) -> int:
        return self._state.updates


class ShardServer:
    """Shard `setup.shard` of the layout; `mode` decides what pushes and fetches do, `rule`
    (its state is what the shard checkpoints besides the values) applies what the mode asks.
    `group`: where the peers are (default: the default process group)."""

    def __init__(
        self,
        setup: ShardSetup,
        state: ShardState,
        mode: Mode,
        rule: UpdateRule | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.setup, self.state, self.mode, self.rule = setup, state, mode, rule
        self.shard, self.replicas, self.rank = setup.shard, setup.replicas, setup.rank
        if rule is not None:  # the checkpointed optimizer state is the rule's
            if rule.values is not state.values:
                raise ValueError("the update rule must apply to the shard's own values")
            state.state = rule.state
        layout = setup.layout
        self.workers = layout.peers(self.shard)
        self.routes = {w: layout.routes(w)[self.shard] for w in self.workers}
        self.size = int(layout.shard_sizes()[self.shard])
        self.cond = threading.Condition()  # the lock of all bookkeeping; fetches wait on it
        self._group = group
        self._ending = threading.Event()  # something that may end serving happened
        self._updated = threading.Event()  # the update count reached `_wake_at`
        self._wake_at = 1
        self._keep_at = 0  # a copy to take at that update count (`keep_at`)
        self._keep_every = 0  # and again every so many updates after it (0: once)
        self._kept: dict[int, ShardState] = {}  # update count -> the copy taken there
        self.lost: dict[int, str] = {}  # replica -> why
        self.done: dict[tuple[int, int], None] = {}  # peers that said goodbye
        self.pushed = {
            (r, w): state.progress.get(r, 0) for r in range(self.replicas) for w in self.workers
        }
        self.bytes_in = self.bytes_out = 0
        self.staleness: collections.Counter[int] = collections.Counter()
        self.last_staleness: dict[tuple[int, int], int] = {}
        self.fatal: str | None = None  # why this shard cannot go on (a checkpoint not written)
        self.diverged: tuple[int, int] | None = None  # (replica, step) whose loss was not finite
        self.commands_done = not mode.commands
        self.view = _View(self)

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group if self._group is not None else dist.group.WORLD

    # ---- serving -------------------------------------------------------------------------
    def serve(self, stop: threading.Event | None = None, grace: float = 60.0) -> None:
        """Serve until every peer said goodbye or was lost (or `grace` s after `stop` is set)."""
        for t in serving_threads(self):
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

    def _finished(self) -> bool:
        return self.commands_done and all(
            (r, w) in self.done or r in self.lost
            for r in range(self.replicas)
            for w in self.workers
        )

    def link(self, replica: int, worker: int) -> Link:
        """The buffers of peer (replica, worker)."""
        n = segments_length(self.routes[worker])
        dtype = self.state.values.dtype
        return Link(
            replica,
            worker,
            self.setup.rank_of(replica, worker),
            self.routes[worker],
            request_buffer(n, dtype),
            torch.empty(n, dtype=dtype),
            request_buffer(n, dtype) if combined_reply(n) else None,
        )

    def take(self, link: Link) -> tuple[int, int, int]:
        """A request received in `link.request`: check its header and take in its push (the
        later chunks included); (kind, step, extra)."""
        replica, worker, n = link.replica, link.worker, link.payload.numel()
        kind, sender, shard, step, length, rep, extra = read_header(link.request)
        if (sender, shard, rep) != (link.src, self.shard, replica):
            raise ProtocolError(
                f"shard {self.shard}: header from rank {link.src} says sender {sender}, "
                f"shard {shard}, replica {rep}"
            )
        if kind in PUSHES:
            if length != n:
                raise ProtocolError(
                    f"shard {self.shard}: push of {length} values from replica "
                    f"{replica} worker {worker}, the layout says {n}"
                )
            first = values_of(link.request, link.payload.dtype, min(n, CHUNK))
            self._receive(Push(replica, worker, step, extra, link.segments), first, link)
            self._count(bytes_in=n * link.payload.element_size())
        return kind, step, extra

    def _receive(self, push: Push, first: torch.Tensor, link: Link) -> None:
        """A push whose first chunk came with its request: its later chunks into the link's
        payload (handed to the mode as each lands, where it folds them), then the whole push
        to the mode, recorded, under one hold of the lock."""
        posted = post_chunks(self.group, link.payload, link.src)
        chunks = [(0, first)] + [(a, link.payload[a:b]) for (a, b), _ in posted]
        for (lo, values), work in zip(chunks, [None, *(w for _, w in posted)], strict=True):
            if work is not None:
                work.wait()
            if self.mode.folds_chunks:
                with self.cond:
                    if not self._dropped(push):
                        self.mode.fold(self.view, push, values, lo, lo + values.numel())
        with self.cond:
            if self._dropped(push):
                return
            if self.mode.records_pushes:
                self._record(push)
            self._apply(
                self.mode.pushed(self.view, push, None if self.mode.folds_chunks else chunks)
            )
            self.cond.notify_all()

    def _dropped(self, push: Push) -> bool:
        """(Under the lock) a lost replica's pushes in flight are dropped, where the mode
        says so."""
        return push.replica in self.lost and not self.mode.keeps_lost_pushes

    def _record(self, push: Push) -> None:
        """(Under the lock) how far the pusher's replica got, and the push's staleness."""
        replica, worker = push.replica, push.worker
        self.pushed[(replica, worker)] = push.step
        self.state.progress[replica] = min(self.pushed[(replica, w)] for w in self.workers)
        if push.version >= 0:
            stale = max(0, self.mode.version(self.view) - push.version)
            self.staleness[stale] += 1
            self.last_staleness[(replica, worker)] = stale

    def _apply(self, response: Response) -> None:
        """(Under the lock) what a mode asked: gradients through the rule, the update count."""
        for at, grad in response.apply:
            self.rule.apply(at, grad)
        if response.clock is not None:
            self.state.clock = response.clock
        if response.updates:
            self.state.updates += response.updates
            if self.state.updates >= self._wake_at:
                self._updated.set()
            if self._keep_at and self.state.updates >= self._keep_at:
                self._kept[self._keep_at] = self._copy()
                self._keep_at = self._keep_at + self._keep_every if self._keep_every else 0

    def answer(self, link: Link, kind: int, step: int, extra: int) -> bool:
        """Answer a taken request as its kind says; True after a goodbye."""
        local = kind == Kind.PUSH_FETCH_LOCAL
        current = self.mode.current(link.replica, link.worker) if local else None
        if current is not None:
            self._reply_current(link, current)
        elif kind in (Kind.FETCH, Kind.FETCH_LOCAL):
            held = extra if kind == Kind.FETCH_LOCAL else -1
            self._reply(link, self.waits_for(kind, step), held)
        elif kind in (Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL):
            self._reply(link, self.waits_for(kind, step))
        elif kind == Kind.BYE:
            self._goodbye(link.replica, link.worker, diverged_at=step if extra == DIVERGED else 0)
            return True
        elif kind != Kind.PUSH:
            raise ProtocolError(f"shard {self.shard}: unknown message kind {kind}")
        return False

    def waits_for(self, kind: int, step: int) -> int:
        """The step a request's answer waits for: a fetch's own, a push-and-fetch's as the
        mode says, none (0) for a push alone or a goodbye."""
        if kind in (Kind.FETCH, Kind.FETCH_LOCAL):
            return step
        if kind in (Kind.PUSH_FETCH, Kind.PUSH_FETCH_LOCAL):
            return self.mode.answer_after_push(step)
        return 0

    def drop(self, link: Link, exc: Exception) -> None:
        """A peer's connection failed or it broke the protocol: its replica is lost."""
        reason = str(exc) if isinstance(exc, ProtocolError) else transport_reason(exc)
        self.lose(link.replica, f"worker {link.worker}: {reason}")

    def ready(self, link: Link, kind: int, step: int) -> bool:
        """Whether a taken request's answer would not wait."""
        with self.cond:
            return self.mode.ready(self.view, link.replica, self.waits_for(kind, step))

    def _reply(self, link: Link, upto: int, held: int = -1) -> None:
        """Answer a fetch (once step `upto` is applied): one message [header | values] when
        they fit one chunk, else a header and the values. The values are copied under the
        lock where the mode may change them while the reply travels (Downpour), so a reply
        always shows whole updates. If the shard is still at version `held` (>= 0: the
        version a worker with local steps holds), the answer is CURRENT."""
        n, reply, dtype = link.payload.numel(), link.reply, self.state.values.dtype
        snapshot = values_of(reply, dtype, n) if reply is not None else None
        if snapshot is None and self.mode.changes_while_served:  # freed once sent
            snapshot = torch.empty(n, dtype=dtype)
        out, version, stale = self._values(link, upto, snapshot, held)
        if out is None:
            self._reply_current(link, version, stale)
            return
        head = (int(Kind.PARAMS), self.rank, self.shard, version, out.numel(), link.replica, stale)
        if reply is not None:
            write_header(reply, *head)
            self.group.send([reply], link.src, TAG_HEADER).wait()
        else:
            self.group.send([torch.tensor(head, dtype=torch.int64)], link.src, TAG_HEADER).wait()
            self.group.send([out], link.src, TAG_PAYLOAD).wait()
        self._count(bytes_out=out.numel() * out.element_size())

    def _values(self, link: Link, step: int, into: torch.Tensor | None, held: int):
        """(values, version, staleness of this peer's last push) for a fetch, once the mode
        says the values are ready for `step`. With `into`, the values are copied there under
        the lock (a snapshot no update tears); without, one segment is returned as a view.
        No values (None) if the version is `held`: the peer holds these values."""
        peer = (link.replica, link.worker)
        with self.cond:
            while not self.mode.ready(self.view, link.replica, step):
                self.cond.wait(timeout=0.5)
            version = self.mode.version(self.view)
            stale = self.last_staleness.get(peer, -1)
            if held >= 0 and version == held:
                return None, held, stale
            values = self.state.values
            parts = [values[s.shard_lo : s.shard_lo + s.length] for s in link.segments]
            if into is not None and len(parts) > 1:
                out = torch.cat(parts, out=into)
            elif into is not None:
                out = into.copy_(parts[0])
            else:
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.mode.served(link.replica, link.worker, version, out)
        return out, version, stale

    def _reply_current(self, link: Link, version: int, stale: int = 0) -> None:
        """Answer a fetch from a worker whose values are the shard's (a PUSH_FETCH_LOCAL whose
        push was the only update since the values it was computed on, or a FETCH_LOCAL at the
        version it holds): a CURRENT header with that version (and an empty payload message
        where the worker expects the values apart); `stale`: of the peer's last push."""
        head = header(Kind.CURRENT, self.rank, self.shard, version, 0, link.replica, stale)
        self.group.send([head], link.src, TAG_HEADER).wait()
        if link.reply is None:
            self.group.send([head[:0]], link.src, TAG_PAYLOAD).wait()

    def _goodbye(self, replica: int, worker: int, diverged_at: int = 0) -> None:
        with self.cond:
            if diverged_at and self.diverged is None:  # its loss was not finite: no push
                self.diverged = (replica, diverged_at)
            self.done[(replica, worker)] = None
            self._apply(self.mode.settle(self.view))  # sync: stop waiting for it
            self.cond.notify_all()
        self._ending.set()

    def _count(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self.cond:  # peers run in threads: count under the lock
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def command(self, op: Op, args: tuple[float, ...]) -> float:
        """The mode's answer to a coordinator's operation, asked again as pushes arrive
        until it has one (Sandblaster)."""
        with self.cond:
            while True:
                response = self.mode.command(self.view, op, args, time.monotonic())
                if response.value is not None:
                    break
                self.cond.wait(timeout=0.2)
            self._apply(response)
            return response.value

    def end_commands(self) -> None:
        """The coordinator is done (or gone): serving may end once the peers are."""
        with self.cond:
            self.commands_done = True
            self.cond.notify_all()
        self._ending.set()

    # ---- for the shard's owner ------------------------------------------------------------
    def lose(self, replica: int, why: str) -> None:
        """Stop waiting for `replica`: its pushes in flight are dropped, its fetches answered."""
        with self.cond:
            if replica not in self.lost:
                log.warning("shard %d: replica %d lost (%s)", self.shard, replica, why)
                self.lost[replica] = why
                self._apply(self.mode.settle(self.view))
            self.cond.notify_all()
        self._ending.set()

    def fail(self, why: str) -> None:
        """This shard cannot go on: `serve` raises RuntimeFailure(why) instead of waiting."""
        with self.cond:
            self.fatal = self.fatal or why
        self._ending.set()

    def wait_update(self, until: int, timeout: float) -> int:
        """The update count, once it reaches `until` (or after `timeout` seconds)."""
        with self.cond:
            if self.state.updates >= until:
                return self.state.updates
            self._wake_at = until
            self._updated.clear()
        self._updated.wait(timeout)
        with self.cond:
            return self.state.updates

    def snapshot(self) -> ShardState:
        """A consistent copy of the shard's state (for checkpoints)."""
        with self.cond:
            return self._copy()

    def keep_at(self, updates: int, every: int = 0) -> None:
        """Copy the state when the update count first reaches `updates`, on the update path
        (a snapshot of exactly that update, not of a later one), and with `every` again at
        each `every` updates after it; `kept` hands a copy over. Copies are kept until a
        later one is handed over, so a reader that lags finds each count's own."""
        with self.cond:
            self._keep_at, self._kept, self._keep_every = updates, {}, every

    def kept(self, updates: int | None = None) -> ShardState | None:
        """The copy taken at `updates` (None: the latest taken), older copies dropped; None
        where there is none."""
        with self.cond:
            if not self._kept:
                return None
            at = max(self._kept) if updates is None else updates
            for older in [k for k in self._kept if k < at]:
                del self._kept[older]
            return self._kept.get(at)

    def _copy(self) -> ShardState:
        s = self.state
        return ShardState(
            values=s.values.clone(),
            state=None if s.state is None else s.state.clone(),
            clock=s.clock,
            updates=s.updates,
            progress=dict(s.progress),
        )
