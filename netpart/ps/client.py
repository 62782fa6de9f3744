"""ShardClient: a model worker's side of the parameter server (protocol in `netpart.ps.protocol`).

Requests are posted without blocking, from the caller's thread or (Downpour) by a courier's
thread, so the step loop touches no socket: `request` sends a push, a fetch or both
to every shard that holds part of this worker's parameters and returns a `Ticket`;
`complete(ticket)` waits for its messages and returns the fetched values. A Downpour worker
keeps two requests in flight and completes each one step after the next was posted, so no
step waits for a round trip; sync mode completes each request at once.

A push's gradients are read until its ticket completes: do not change them before. Buffers
from `push_buffers` carry a header in front, so a push from one goes out with no copy. The
values `complete` returns (the reply's own bytes when one shard holds them all) stay valid
until `complete` returns newer ones: a caller may make its parameters views of them. A fetch
whose slot had to be taken back before it was completed is dropped (`complete` gives None).

A client made with `local_steps` (its caller applies every push to its own parameters too)
asks the shards to answer CURRENT where nothing but its own pushes changed their values: such
a fetch moves no values, and when every shard answers so, `complete` gives None and the
caller's values stay what they are (`Ticket.current` names the shards that did).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from netpart.compile.shards import Segment, ShardLayout
from netpart.errors import PeerError, ProtocolError, transport_reason
from netpart.ps.protocol import (
    CHUNK,
    DIVERGED,
    HEADER_BYTES,
    HEADER_LEN,
    TAG_HEADER,
    TAG_PAYLOAD,
    VALUES_AT,
    Kind,
    combined_reply,
    header,
    later_chunks,
    read_header,
    request_buffer,
    segments_length,
    values_of,
    write_header,
)

__all__ = ["ShardClient", "Ticket"]


@dataclass
class Ticket:
    """A posted request: its slot, and the messages to complete."""

    slot: int
    step: int
    fetch: bool
    works: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # tensors that must live until completion
    targets: dict = field(default_factory=dict)  # shard -> where a separate reply lands
    done: bool = False
    values: torch.Tensor | None = None  # fetched, once done
    dropped: bool = False  # its slot was taken back: the fetch is lost
    current: tuple[int, ...] = ()  # shards that answered CURRENT (no values), once done
    finished: threading.Event | None = None  # set by the courier when all its messages are
    error: RuntimeError | None = None  # what the courier's sends or receives raised


class _Push:
    """A push buffer that lies behind room for a header (`raw`): its messages, made once:
    the header and first chunk, then the later chunks (tensor, tag)."""

    def __init__(self, raw: torch.Tensor, payload: torch.Tensor) -> None:
        self.raw, self.payload = raw, payload
        first = min(payload.numel(), CHUNK) * payload.element_size()
        self.messages = [(raw[: VALUES_AT + first], TAG_HEADER)] + [
            (payload[a:b], tag) for (a, b), tag in later_chunks(payload.numel())
        ]


class _Slot:
    """The buffers of one request in flight: per shard, its request bytes and reply target."""

    def __init__(self, routes: dict[int, tuple[Segment, ...]], size: int, dtype: torch.dtype):
        self.values = torch.zeros(size, dtype=dtype)  # fetched values, in the worker's order
        self.requests = {s: request_buffer(segments_length(g), dtype) for s, g in routes.items()}
        self.replies: dict[int, torch.Tensor] = {}
        for s, segs in routes.items():
            n = segments_length(segs)
            self.replies[s] = (
                request_buffer(n, dtype)  # [header | all values]
                if combined_reply(n)
                else torch.empty(HEADER_LEN, dtype=torch.int64)
            )
        self.ticket: Ticket | None = None


class _Courier:
    """Two threads that carry requests: one posts each request's receives and messages and
    waits until they are written, the other waits for each request's replies, in order, and
    then flags the ticket `finished`. Writing a push into the socket (gloo writes on the
    calling thread) thus runs beside the next step; the step loop can ask whether a fetch has
    arrived without waiting (gloo's operations cannot be polled); and a slow reply never
    holds up the next request. The transport releases the GIL while it writes and waits."""

    def __init__(self, name: str, group: dist.ProcessGroup) -> None:
        self.group = group
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sent: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._send, name=f"{name}-send", daemon=True),
            threading.Thread(target=self._receive, name=f"{name}-receive", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def post(self, ticket: Ticket, receives: list, sends: list) -> None:
        """Carry a request: post its `receives` and `sends` (tensor, peer, tag) and wait until
        the sends are written (here, not in the step loop: the step loop then touches no
        socket)."""
        ticket.finished = threading.Event()
        self.outbox.put((ticket, receives, sends))

    def _send(self) -> None:
        _yield_to_compute()
        pg = self.group
        while (item := self.outbox.get()) is not None:
            ticket, receives, sends = item
            try:
                ticket.works += [pg.recv([t], src, tag) for t, src, tag in receives]
                for work in [pg.send([t], dst, tag) for t, dst, tag in sends]:
                    work.wait()
            except RuntimeError as exc:  # the caller raises it, naming itself
                ticket.error = exc
            self.sent.put(ticket)
        self.sent.put(None)

    def _receive(self) -> None:
        _yield_to_compute()
        while (ticket := self.sent.get()) is not None:
            try:
                if ticket.error is None:
                    for work in ticket.works:  # its receives, posted with the request
                        work.wait()
            except RuntimeError as exc:
                ticket.error = exc
            finally:
                ticket.finished.set()

    def close(self) -> None:
        self.outbox.put(None)
        for t in self.threads:
            t.join()


def _yield_to_compute() -> None:
    """The calling thread becomes SCHED_BATCH: a fair share of the CPU, but its wake-ups never
    preempt the step loop's thread, whose compute the courier would otherwise interrupt."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


class ShardClient:
    """Model worker `worker` of replica `replica` (global `rank`): its requests to the shards
    (`shard_ranks[s]`: shard s's rank), `depth` of them in flight at most. With `background`,
    a courier thread sends them and waits for their replies (Downpour: the step loop never
    waits for a push, and takes fetched values once they have arrived). `group`: where the
    shards are (default: the default process group)."""

    def __init__(
        self,
        layout: ShardLayout,
        *,
        worker: int,
        replica: int,
        rank: int,
        shard_ranks: list[int],
        dtype: torch.dtype,
        depth: int = 3,
        background: bool = False,
        local_steps: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.worker, self.replica, self.rank, self.shard_ranks = worker, replica, rank, shard_ranks
        self.routes = layout.routes(worker)
        self.size = layout.worker_size(worker)
        self.dtype = dtype
        if depth < 2:
            raise ValueError("a client needs two slots at least (one holds fetched values)")
        self._slots = [_Slot(self.routes, self.size, dtype) for _ in range(depth)]
        self._next = 0
        self._held: int | None = None  # the slot whose values the caller holds
        self._pushes: dict[int, _Push] = {}  # data_ptr of a push buffer -> its messages
        self.version = -1  # the oldest shard version in the newest fetch
        self.staleness = -1  # the largest staleness the shards reported in the newest fetch
        self._used: dict[int, int] = {}  # per shard, the version of the values last fetched
        self.group = group if group is not None else dist.group.WORLD
        self._courier = _Courier(f"ps-{replica}-{worker}", self.group) if background else None
        self.local_steps = local_steps
        self.received = 0  # values received in fetches' replies

    # ---- requests ------------------------------------------------------------------------
    def request(
        self,
        step: int,
        grads: torch.Tensor | None = None,
        fetch: bool = False,
        fetch_step: int = 0,
        extra: int | None = None,
        ahead: int = 0,
    ) -> Ticket:
        """Post a push of `grads` (flat, this worker's piece order; computed on the values last
        fetched, and `ahead` of this worker's later pushes applied locally) and/or a fetch to
        every shard. A fetch alone is answered once `fetch_step` is applied (0: at once); a
        push-and-fetch as the shard's mode says (sync: once `step` is applied by every replica).
        `extra` replaces the versions in push headers (Sandblaster: the evaluation its unit
        belongs to)."""
        index, slot = self._take_slot()
        local = self.local_steps
        if grads is not None and fetch:
            kind = Kind.PUSH_FETCH_LOCAL if local else Kind.PUSH_FETCH
        elif grads is not None:
            kind = Kind.PUSH
        else:
            kind = Kind.FETCH_LOCAL if local else Kind.FETCH
        ticket = Ticket(index, step, fetch)
        sends: list[tuple[torch.Tensor, int, int]] = []
        receives: list[tuple[torch.Tensor, int, int]] = []
        at = fetch_step if kind in (Kind.FETCH, Kind.FETCH_LOCAL) else step
        with self._naming("post to"):
            for s, segs in self.routes.items():
                what = (kind, at, extra, ahead)
                self._post(ticket, slot, s, segs, what, grads, (sends, receives))
            if self._courier is not None:  # this thread touches no socket
                self._courier.post(ticket, receives, sends)
            else:  # on the group itself: a quarter cheaper than isend
                pg = self.group
                ticket.works += [pg.recv([t], src, tag) for t, src, tag in receives]
                ticket.works += [pg.send([t], dst, tag) for t, dst, tag in sends]
        slot.ticket = ticket
        return ticket

    def push_buffers(self, count: int) -> list[torch.Tensor]:
        """`count` zeroed flat gradient buffers (this worker's piece order). When one shard
        holds all of this worker's values, each lies behind room for a header, and a push from
        it is sent where it lies."""
        single = len(self.routes) == 1 and len(next(iter(self.routes.values()))) == 1
        out = []
        for _ in range(count):
            if not single:
                out.append(torch.zeros(self.size, dtype=self.dtype))
                continue
            raw = torch.zeros(VALUES_AT + self.size * self.dtype.itemsize, dtype=torch.uint8)
            values = values_of(raw, self.dtype, self.size)
            self._pushes[values.data_ptr()] = _Push(raw, values)
            out.append(values)
        return out

    def _take_slot(self) -> tuple[int, _Slot]:
        """The next slot not holding the caller's values; one still in flight is completed
        first and its fetch dropped (never reuse buffers a message may still write)."""
        k = self._next
        if k == self._held:
            k = (k + 1) % len(self._slots)
        self._next = (k + 1) % len(self._slots)
        slot = self._slots[k]
        if slot.ticket is not None and not slot.ticket.done:
            self._wait(slot.ticket)
            slot.ticket.dropped = True
        return k, slot

    def _post(self, ticket, slot, s, segs, what, grads, messages) -> None:
        """Shard `s`'s part of a request: its messages and receives (tensor, peer, tag)
        appended to `messages` (sends, receives)."""
        (kind, step, extra, ahead), dst, n = what, self.shard_ranks[s], segments_length(segs)
        sends, receives = messages
        buf = slot.requests[s]
        # The version a push was computed on: the fetched values' (the shard's update count
        # then), plus this worker's pushes that had not reached them but were applied locally:
        # the shard's staleness then counts only the updates the gradient did not see.
        used = self._used.get(s, -1)
        version = extra if extra is not None else used + ahead if used >= 0 else -1
        head = (int(kind), self.rank, s, step, n if grads is not None else 0, self.replica)
        own = self._pushes.get(grads.data_ptr()) if grads is not None else None
        if own is not None and grads.numel() == n:  # the header goes in front: no copy
            write_header(own.raw, *head, version)
            sends += [(msg, dst, tag) for msg, tag in own.messages]
            ticket.keep.append(own.payload)
        elif grads is None:
            write_header(buf, *head, version)
            sends.append((buf[:HEADER_BYTES], dst, TAG_HEADER))
        else:
            write_header(buf, *head, version)
            parts = [grads[g.local_lo : g.local_lo + g.length] for g in segs]
            payload = parts[0] if len(parts) == 1 else torch.cat(parts)
            first = min(n, CHUNK)
            values_of(buf, payload.dtype, first).copy_(payload[:first])
            sends.append((buf, dst, TAG_HEADER))
            sends += [(payload[a:b], dst, tag) for (a, b), tag in later_chunks(n)]
            ticket.keep.append(payload)
        if kind != Kind.PUSH:
            receives.append((slot.replies[s], dst, TAG_HEADER))
            if not combined_reply(n):
                target = ticket.targets[s] = self._direct(slot, segs)
                receives.append((target, dst, TAG_PAYLOAD))

    def _direct(self, slot: _Slot, segs: tuple[Segment, ...]) -> torch.Tensor:
        """Where a separate reply's values land: the staging buffer itself for one segment."""
        if len(segs) == 1:
            return slot.values[segs[0].local_lo : segs[0].local_lo + segs[0].length]
        return torch.empty(segments_length(segs), dtype=self.dtype)

    def complete(self, ticket: Ticket) -> torch.Tensor | None:
        """Wait for the ticket's messages; the fetched values (None for a push alone, a
        dropped fetch, or one every shard answered CURRENT: the caller keeps its values)."""
        self._wait(ticket)
        if ticket.dropped or ticket.values is None:
            return None
        self._held = ticket.slot
        return ticket.values

    def arrived(self, ticket: Ticket) -> bool:
        """Whether `complete(ticket)` would return at once (always False without a courier:
        gloo's operations cannot be polled)."""
        return ticket.done or (ticket.finished is not None and ticket.finished.is_set())

    def _wait(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        with self._naming("hear from"):
            if ticket.finished is not None:  # the courier waits for its works (only it may)
                ticket.finished.wait()  # it always sets it
                if ticket.error is not None:
                    raise ticket.error
            else:
                for work in ticket.works:
                    work.wait()
        ticket.done = True
        if ticket.fetch:
            ticket.values = self._unpack(ticket)

    def current_ranges(self, ticket: Ticket) -> list[tuple[int, int]]:
        """[lo, hi) of this worker's flat values held by the shards that answered `ticket`
        CURRENT (their part of the fetched values was not sent: the caller's are those)."""
        segs = (g for s in ticket.current for g in self.routes[s])
        return [(g.local_lo, g.local_lo + g.length) for g in segs]

    def _unpack(self, ticket: Ticket) -> torch.Tensor | None:
        """The fetched values in this worker's order (None if every shard answered CURRENT)."""
        slot = self._slots[ticket.slot]
        values = slot.values
        version, versions, stale, current = None, {}, -1, []
        for s, segs in self.routes.items():
            n, reply = segments_length(segs), slot.replies[s]
            kind, _sender, shard, v, length, _rep, extra = (
                read_header(reply) if combined_reply(n) else reply.tolist()
            )
            if kind == Kind.CURRENT and shard == s and length == 0:
                version = v if version is None else min(version, v)
                versions[s], stale = v, max(stale, extra)
                current.append(s)
                continue
            if kind != Kind.PARAMS or shard != s or length != n:
                raise ProtocolError(
                    f"replica {self.replica} worker {self.worker}: bad reply from shard {s} "
                    f"(kind {kind}, shard {shard}, {length} values, expected {n})"
                )
            version = v if version is None else min(version, v)
            versions[s], stale = v, max(stale, extra)
            self.received += n
            data = values_of(reply, self.dtype, n) if combined_reply(n) else ticket.targets[s]
            if len(self.routes) == 1 and len(segs) == 1 and n == self.size:
                values = data  # one shard holds it all, in order: no staging copy
                continue
            if not combined_reply(n) and len(segs) == 1:
                continue  # landed in place
            off = 0
            for g in segs:
                slot.values[g.local_lo : g.local_lo + g.length] = data[off : off + g.length]
                off += g.length
        self._used = versions
        self.version = -1 if version is None else version
        self.staleness = stale
        ticket.current = tuple(current)
        return None if len(current) == len(self.routes) else values

    def close(self, diverged_at: int = 0) -> None:
        """Complete what is in flight, then say goodbye to every shard (`diverged_at`: the
        step whose loss was not finite; the shards then keep their last checkpoint)."""
        for slot in self._slots:
            if slot.ticket is not None:
                self._wait(slot.ticket)
        if self._courier is not None:
            self._courier.close()
        with self._naming("say goodbye to"):
            for s in self.routes:
                extra = DIVERGED if diverged_at > 0 else -1
                bye = header(Kind.BYE, self.rank, s, diverged_at, 0, self.replica, extra)
                self.group.send([bye], self.shard_ranks[s], TAG_HEADER).wait()

    @contextlib.contextmanager
    def _naming(self, what: str):
        """Re-raise a transport error as PeerError naming this worker."""
        try:
            yield
        except RuntimeError as exc:
            raise PeerError(
                f"replica {self.replica} worker {self.worker}: could not {what} a "
                f"parameter-server shard: shard unreachable ({transport_reason(exc)})"
            ) from None
