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
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from netpart.errors import PeerError, transport_reason

__all__ = ["PEER_LOST", "GlooTransport", "Handle", "Transport"]

PEER_LOST = "peer dead or past the timeout"


@dataclass
class Handle:
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

    def send(self, tag: int, peer: int, tensor: torch.Tensor) -> Handle:
        with self._naming("send to", peer, tag):  # posting can fail too: a closed connection
            work = dist.isend(tensor, self.ranks[peer], self.group, tag=tag)
        return Handle("send to", peer, tag, work, tensor)

    def recv(self, tag: int, peer: int, buffer: torch.Tensor) -> Handle:
        with self._naming("receive from", peer, tag):
            work = dist.irecv(buffer, self.ranks[peer], self.group, tag=tag)
        return Handle("receive from", peer, tag, work, buffer)

    def wait(self, handles: list[Handle]) -> None:
        for h in handles:
            with self._naming(h.what, h.peer, h.tag):
                h.work.wait()

    @contextlib.contextmanager
    def _naming(self, what: str, peer: int, tag: int):
        """Re-raise a process-group error as PeerError naming the peer and the phase."""
        try:
            yield
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: {what} worker {peer} failed in phase {tag} "
                f"({PEER_LOST}): {transport_reason(exc)}"
            ) from None

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
        with self._collective("all-gather"):
            dist.all_gather_into_tensor(out, tensor.contiguous(), self.group)
        return out

    @contextlib.contextmanager
    def _collective(self, what: str):
        try:
            yield
        except RuntimeError as exc:
            raise PeerError(
                f"worker {self.rank}: {what} failed ({PEER_LOST}): {transport_reason(exc)}"
            ) from None
