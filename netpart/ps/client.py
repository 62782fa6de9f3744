"""ShardClient: a model worker's side of the parameter server (protocol in `netpart.ps.protocol`).

It runs the worker's pushes and fetches in a background thread, so the replica keeps
computing while messages fly; fetched parameters land in one of two staging buffers and are
swapped in by the caller between steps.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from netpart.errors import PeerError, ProtocolError, transport_reason
from netpart.partition.shards import ShardLayout
from netpart.ps.protocol import (
    HEADER_LEN,
    TAG_CHUNK,
    TAG_HEADER,
    TAG_PAYLOAD,
    Kind,
    chunks,
    header,
    segments_length,
)

__all__ = ["ShardClient"]


class ShardClient:
    """Model worker `worker` of replica `replica`: pushes and fetches in a background thread."""

    def __init__(
        self,
        layout: ShardLayout,
        worker: int,
        replica: int,
        rank: int,
        shard_ranks: list[int],
        dtype: torch.dtype,
    ) -> None:
        self.worker, self.replica, self.rank, self.shard_ranks = worker, replica, rank, shard_ranks
        self.routes = layout.routes(worker)
        self.size = layout.worker_size(worker)
        self._buffers = [torch.zeros(self.size, dtype=dtype) for _ in range(2)]
        self._ready: int | None = None  # staging buffer holding the newest parameters
        self._in_use: int | None = None
        self._requests: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self.version = -1  # the oldest shard version in the newest fetch
        self.staleness = -1  # the largest staleness the shards reported in the newest fetch
        self._versions: list[dict[int, int]] = [{}, {}]  # shard -> version, per buffer
        self._used: dict[int, int] = {}  # versions of the parameters last taken
        self._thread = threading.Thread(target=self._run, daemon=True, name="shard-client")
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------
    def push(self, grads: torch.Tensor, step: int, extra: int | None = None) -> threading.Event:
        """Queue `grads` (flat, this worker's piece order), computed on the parameters last
        taken. The client reads `grads` until the returned event is set (`wait_sent`): do not
        change it before. `extra` replaces the versions in the headers (Sandblaster: the
        evaluation the unit belongs to)."""
        self._check()
        versions = dict(self._used) if extra is None else dict.fromkeys(self.routes, extra)
        sent = threading.Event()
        self._submit((Kind.PUSH, step, (grads, versions, sent)))
        return sent

    def wait_sent(self, sent: threading.Event) -> None:
        """Wait until the push that returned `sent` has gone out (raises if the client failed)."""
        while not sent.wait(timeout=0.5):
            self._check()

    def fetch(self, step: int = 0) -> None:
        """Queue a fetch; `step` > 0 makes the shards answer only once that step is applied."""
        self._check()
        self._submit((Kind.FETCH, step, None))

    def take(self, wait: bool = False) -> torch.Tensor | None:
        """The newest fetched parameters not yet taken (with `wait`: after all queued requests).

        The buffer stays reserved until the next `take`; copy it out before then.
        """
        with self._cond:
            while wait and self._outstanding and self._error is None:
                self._cond.wait(timeout=0.5)
            self._check()
            self._in_use = None
            if self._ready is None:
                return None
            self._in_use, self._ready = self._ready, None
            self._used = self._versions[self._in_use]
            self._cond.notify_all()
            return self._buffers[self._in_use]

    def close(self) -> None:
        """Say goodbye to every shard after the queued requests, and stop the thread."""
        if self._error is None and self._thread.is_alive():
            self._submit((Kind.BYE, 0, None))
            self._thread.join()
        self._check()

    # ---- background thread ---------------------------------------------------------------
    def _submit(self, request) -> None:
        with self._cond:
            self._outstanding += 1
        self._requests.put(request)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while True:
                kind, step, data = self._requests.get()
                if kind == Kind.PUSH:
                    grads, versions, sent = data
                    self._send_push(step, grads, versions)
                    sent.set()
                elif kind == Kind.FETCH:
                    self._fetch(step)
                else:
                    for s in self.routes:
                        dist.send(self._hdr(Kind.BYE, s, 0, 0), self.shard_ranks[s], tag=TAG_HEADER)
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()
                if kind == Kind.BYE:
                    return
        except RuntimeError as exc:
            self._fail(f"parameter-server shard unreachable ({transport_reason(exc)})")
        except ProtocolError as exc:
            self._fail(str(exc))

    def _fail(self, why: str) -> None:
        with self._cond:
            self._error = PeerError(f"replica {self.replica} worker {self.worker}: {why}")
            self._cond.notify_all()

    def _hdr(self, kind: Kind, shard: int, step: int, length: int, extra: int = -1):
        return header(kind, self.rank, shard, step, length, self.replica, extra)

    def _send_push(self, step: int, grads: torch.Tensor, versions: dict[int, int]) -> None:
        works, keep = [], []
        for s, segs in self.routes.items():
            parts = [grads[g.local_lo : g.local_lo + g.length] for g in segs]
            payload = parts[0] if len(parts) == 1 else torch.cat(parts)
            hdr = self._hdr(Kind.PUSH, s, step, payload.numel(), versions.get(s, -1))
            keep += [hdr, payload]
            dst = self.shard_ranks[s]
            works.append(dist.isend(hdr, dst, tag=TAG_HEADER))
            for i, (a, b) in enumerate(chunks(payload.numel())):
                works.append(dist.isend(payload[a:b], dst, tag=TAG_CHUNK + i))
        for w in works:
            w.wait()

    def _fetch(self, step: int) -> None:
        with self._cond:  # the buffer the caller is not reading; a newer fetch replaces `ready`
            target = 1 if self._in_use == 0 else 0
            if self._ready == target:
                self._ready = None
        buf = self._buffers[target]
        works, replies = [], []
        for s, segs in self.routes.items():
            dst = self.shard_ranks[s]
            n = segments_length(segs)
            hdr = self._hdr(Kind.FETCH, s, step, 0)
            reply = torch.empty(HEADER_LEN, dtype=torch.int64)
            direct = len(segs) == 1
            data = buf[segs[0].local_lo : segs[0].local_lo + n] if direct else buf.new_empty(n)
            replies.append((s, segs, reply, data, direct, hdr))
            works.append(dist.isend(hdr, dst, tag=TAG_HEADER))
            works.append(dist.irecv(reply, dst, tag=TAG_HEADER))
            works.append(dist.irecv(data, dst, tag=TAG_PAYLOAD))
        for w in works:
            w.wait()
        version, versions, stale = None, {}, -1
        for s, segs, reply, data, direct, _ in replies:
            kind, _sender, shard, v, length, _rep, extra = reply.tolist()
            if kind != Kind.PARAMS or shard != s or length != data.numel():
                raise ProtocolError(
                    f"replica {self.replica} worker {self.worker}: bad reply from shard {s} "
                    f"(kind {kind}, shard {shard}, {length} values, expected {data.numel()})"
                )
            version = v if version is None else min(version, v)
            versions[s], stale = v, max(stale, extra)
            if not direct:
                off = 0
                for g in segs:
                    buf[g.local_lo : g.local_lo + g.length] = data[off : off + g.length]
                    off += g.length
        with self._cond:
            self._ready = target
            self._versions[target] = versions
            self.version = -1 if version is None else version
            self.staleness = stale
            self._cond.notify_all()
