"""Transports: how the model workers of one replica move halos and reduce the loss.

A transport posts point-to-point messages without blocking (`send`, `recv` return handles)
and completes them with `wait`, so a worker can compute while its halo travels. `GlooTransport`
moves every byte through torch.distributed (gloo on CPU; the calls are backend-neutral, so
NCCL works on GPUs); a dead or stuck peer surfaces as an error from the process group after
its timeout, re-raised as `PeerError` naming the peer and the phase. The in-process
transport for unit tests is in `netpart.runtime.inprocess`.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from netpart.errors import PeerError, transport_reason

__all__ = ["PEER_LOST", "GlooTransport", "Handle", "Transport"]

PEER_LOST = "peer dead or past the timeout"
P2P_GATHER_MAX = 8  # up to this many workers, an all-gather is N-1 sends and receives each
GATHER_TAG = 1 << 20  # above every halo tag (2 * layer + phase)


class Handle(NamedTuple):
    """A posted message: what it is (for error messages) and how to complete it."""

    what: str  # "send to" | "receive from"
    peer: int
    tag: int
    work: Any  # a torch.distributed Work, or the in-process transport's state
    tensor: torch.Tensor  # kept alive until the message completes


class Transport(Protocol):
    rank: int
    size: int

    def send(self, tag: int, peer: int, tensor: torch.Tensor) -> Handle:
        """Post `tensor` to `peer` (do not change it before `wait`)."""

    def recv(self, tag: int, peer: int, buffer: torch.Tensor) -> Handle:
        """Post a receive from `peer` into `buffer` (filled once `wait` returns)."""

    def wait(self, handles: list[Handle]) -> None:
        """Complete every posted message."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce `tensor` ("sum" or "max") over all workers, in place; returns it."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *tensor.shape]: every worker's `tensor`, in rank order."""


class GlooTransport:
    """Point-to-point over the default torch.distributed process group (or `group`)."""

    def __init__(self, group: dist.ProcessGroup | None = None, ranks: list[int] | None = None):
        self.group = group
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size(group)))
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        # Messages are posted on the process group itself (a quarter cheaper than isend's
        # checks), addressed by rank within the group.
        self._pg = group if group is not None else dist.group.WORLD
        self._peer = [dist.get_group_rank(self._pg, r) for r in self.ranks]

    def send(self, tag: int, peer: int, tensor: torch.Tensor) -> Handle:
        try:  # posting can fail too: a closed connection
            work = self._pg.send([tensor], self._peer[peer], tag)
        except RuntimeError as exc:
            raise self._lost("send to", peer, tag, exc) from None
        return Handle("send to", peer, tag, work, tensor)

    def recv(self, tag: int, peer: int, buffer: torch.Tensor) -> Handle:
        try:
            work = self._pg.recv([buffer], self._peer[peer], tag)
        except RuntimeError as exc:
            raise self._lost("receive from", peer, tag, exc) from None
        return Handle("receive from", peer, tag, work, buffer)

    def wait(self, handles: list[Handle]) -> None:
        for h in handles:
            try:
                h.work.wait()
            except RuntimeError as exc:
                raise self._lost(h.what, h.peer, h.tag, exc) from None

    def _lost(self, what: str, peer: int, tag: int, exc: RuntimeError) -> PeerError:
        """A process-group error as a PeerError naming the peer and the phase."""
        return PeerError(
            f"worker {self.rank}: {what} worker {peer} failed in phase {tag} "
            f"({PEER_LOST}): {transport_reason(exc)}"
        )

    def barrier(self) -> None:
        with self._collective("barrier"):
            dist.barrier(self.group)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        with self._collective("all-reduce"):
            dist.all_reduce(tensor, red, self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty(self.size, *tensor.shape)
        if self.size <= P2P_GATHER_MAX:  # point to point, on this thread: no hand-offs
            out[self.rank] = tensor
            handles = [self.send(GATHER_TAG, p, tensor) for p in range(self.size) if p != self.rank]
            handles += [
                self.recv(GATHER_TAG, p, out[p]) for p in range(self.size) if p != self.rank
            ]
            self.wait(handles)
            return out
        with self._collective("all-gather"):
            dist.all_gather(list(out.unbind(0)), tensor.contiguous(), self.group)
        return out

    @contextlib.contextmanager
    def _collective(self, what: str):
        try:
            yield
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: {what} failed ({PEER_LOST}): {transport_reason(exc)}"
            ) from None
