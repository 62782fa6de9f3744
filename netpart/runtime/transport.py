"""Transports: how model workers of one replica exchange halos and reduce the loss.

`GlooTransport` moves every byte through torch.distributed point-to-point (gloo on CPU; the
calls are backend-neutral so NCCL works on GPUs). All messages of a phase are posted at once
(isend/irecv) and then waited for, so the lockstep schedule cannot deadlock; a dead or stuck
peer surfaces as an error from the process group after its timeout, re-raised naming the peer.
`ThreadTransport` runs N workers as threads of one process: for unit tests only.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from typing import Protocol

import torch
import torch.distributed as dist

from netpart.errors import RuntimeFailure
from netpart.runtime.schedule import ShapeMismatchError

__all__ = ["PEER_LOST", "GlooTransport", "PeerError", "ThreadTransport", "Transport"]

PEER_LOST = "peer dead or past the timeout"


class PeerError(RuntimeFailure):
    """A peer died, hung past the timeout, or broke the protocol."""


class Transport(Protocol):
    rank: int
    size: int

    def exchange(
        self, tag: int, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]
    ) -> None:
        """Send each tensor to its peer and fill each receive buffer from its peer."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce `tensor` ("sum" or "max") over all workers, in place; returns it."""


class GlooTransport:
    """Point-to-point over the default torch.distributed process group (or `group`)."""

    def __init__(self, group: dist.ProcessGroup | None = None, ranks: list[int] | None = None):
        self.group = group
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size(group)))
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)

    def exchange(self, tag, sends, recvs):
        ops = [("send to", peer, dist.isend, t) for peer, t in sends.items()]
        ops += [("receive from", peer, dist.irecv, buf) for peer, buf in recvs.items()]
        works = []
        for what, peer, post, tensor in ops:  # posting can fail too: a closed connection
            with self._naming(what, peer, tag):
                works.append((what, peer, post(tensor, self.ranks[peer], self.group, tag=tag)))
        for what, peer, work in works:
            with self._naming(what, peer, tag):
                work.wait()

    @contextlib.contextmanager
    def _naming(self, what: str, peer: int, tag: int):
        """Re-raise a process-group error as PeerError naming the peer and the phase."""
        try:
            yield
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: {what} worker {peer} failed in phase {tag} "
                f"({PEER_LOST}): {_gloo_reason(exc)}"
            ) from None

    def barrier(self) -> None:
        try:
            dist.barrier(self.group)
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: barrier failed ({PEER_LOST}): {_gloo_reason(exc)}"
            ) from None

    def all_reduce(self, tensor, op):
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        try:
            dist.all_reduce(tensor, red, self.group)
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: all-reduce failed ({PEER_LOST}): {_gloo_reason(exc)}"
            ) from None
        return tensor


def _gloo_reason(exc: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


class _Hub:
    """Shared mailboxes and a reduction barrier for ThreadTransport."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.failed = threading.Event()

    def fail(self) -> None:
        """A worker died: wake everyone waiting instead of letting them time out."""
        self.failed.set()
        self.barrier.abort()

    def box(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())


class ThreadTransport:
    """In-process stand-in for tests: workers are threads, messages are cloned tensors."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    @classmethod
    def group(cls, size: int, timeout: float = 30.0) -> list[ThreadTransport]:
        hub = _Hub(size, timeout)
        return [cls(hub, r) for r in range(size)]

    def exchange(self, tag, sends, recvs):
        for peer, t in sends.items():
            self.hub.box((tag, self.rank, peer)).put(t.clone())
        for peer, buf in recvs.items():
            box = self.hub.box((tag, peer, self.rank))
            deadline = time.monotonic() + self.hub.timeout
            while True:
                try:
                    got = box.get(timeout=0.05)
                    break
                except queue.Empty:
                    if self.hub.failed.is_set() or time.monotonic() > deadline:
                        raise PeerError(
                            f"worker {self.rank}: nothing from worker {peer} in phase {tag}"
                        ) from None
            if got.shape != buf.shape:
                raise ShapeMismatchError(
                    f"worker {self.rank}: phase {tag} from worker {peer}: got {tuple(got.shape)}, "
                    f"buffer is {tuple(buf.shape)}"
                )
            buf.copy_(got)

    def all_reduce(self, tensor, op):
        hub = self.hub
        hub.slots[self.rank] = tensor.clone()
        hub.barrier.wait()
        stacked = torch.stack(hub.slots)  # every rank reduces the same values in rank order
        result = stacked.amax(dim=0) if op == "max" else stacked.sum(dim=0)
        hub.barrier.wait()
        tensor.copy_(result)
        return tensor
