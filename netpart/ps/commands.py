"""Sandblaster's messages beyond pushes and fetches (tags in `netpart.ps.protocol`).

- The coordinator's vector operations on every shard (`ShardCommands`, the coordinator's
  side; `serve_commands`, the shard's): a header and four float64 arguments out, a header and
  one float64 back, so no parameter vector reaches the coordinator.
- The work units it hands to a replica's workers (`UnitChannel.assign`; a worker takes them
  with `next_unit`), and the reports worker 0 of a replica sends when one is done
  (`report_unit`; the coordinator reads them from `UnitChannel.next_report`).

Nothing here is pickled: every message is a tensor of numbers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from netpart.errors import RuntimeFailure, transport_reason
from netpart.ps.lbfgs_vectors import name_code
from netpart.ps.protocol import (
    HEADER_LEN,
    TAG_DONE,
    TAG_DONE_VALUE,
    TAG_HEADER,
    TAG_PAYLOAD,
    TAG_UNIT,
    Kind,
    Op,
    header,
)

__all__ = [
    "Report",
    "ShardCommands",
    "Unit",
    "UnitChannel",
    "next_unit",
    "report_unit",
    "serve_commands",
]


def serve_commands(
    group: dist.ProcessGroup,
    coordinator: int,
    rank: int,
    shard: int,
    run: Callable[[Op, tuple[float, ...]], float],
) -> None:
    """The shard's side: receive operations from `coordinator` and answer each with the one
    value `run(op, args)` gives, until STOP; returns then, or when the coordinator is gone
    (RuntimeError from the transport)."""
    head = torch.empty(HEADER_LEN, dtype=torch.int64)
    args = torch.empty(4, dtype=torch.float64)
    while True:
        group.recv([head], coordinator, TAG_HEADER).wait()
        op = Op(int(head[3]))
        group.recv([args], coordinator, TAG_PAYLOAD).wait()
        value = run(op, tuple(args.tolist()))
        group.send([header(Kind.REPLY, rank, shard, int(op), 1, 0)], coordinator, TAG_HEADER).wait()
        group.send([torch.tensor([value], dtype=torch.float64)], coordinator, TAG_PAYLOAD).wait()
        if op == Op.STOP:
            return


class ShardCommands:
    """The coordinator's view of the shard processes (`ranks`): one command to each, one float
    back (what `netpart.train.lbfgs_driver.LBFGSDriver` calls, as on `LocalShards`)."""

    def __init__(self, ranks: list[int], me: int) -> None:
        self.ranks, self.me = ranks, me
        self.bytes_in = 0  # everything the coordinator received from the shards
        self.scalars = 0

    def call(self, op: Op, alpha: float = 0.0, a="x", b="x", c="x") -> list[float]:
        args = torch.tensor([alpha, name_code(a), name_code(b), name_code(c)], dtype=torch.float64)
        works, replies, headers = [], [], []  # every tensor stays alive until its wait
        for s, rank in enumerate(self.ranks):
            headers.append(header(Kind.CMD, self.me, s, int(op), 4, 0))
            reply = (
                torch.empty(HEADER_LEN, dtype=torch.int64),
                torch.empty(1, dtype=torch.float64),
            )
            replies.append(reply)
            works += [dist.isend(headers[-1], rank, tag=TAG_HEADER)]
            works += [dist.isend(args, rank, tag=TAG_PAYLOAD)]
            works += [dist.irecv(reply[0], rank, tag=TAG_HEADER)]
            works += [dist.irecv(reply[1], rank, tag=TAG_PAYLOAD)]
        for w in works:
            w.wait()
        self.bytes_in += sum(h.numel() * 8 + v.numel() * 8 for h, v in replies)
        self.scalars += len(replies)
        return [float(v[0]) for _, v in replies]

    def dot(self, a: str, b: str) -> float:
        return sum(self.call(Op.DOT, a=a, b=b))

    def abs_sum(self, a: str) -> float:
        return sum(self.call(Op.ABS_SUM, a=a))

    def abs_max(self, a: str) -> float:
        return max(self.call(Op.ABS_MAX, a=a))

    def axpy(self, alpha: float, a: str, b: str) -> None:
        self.call(Op.AXPY, alpha, a, b)

    def copy(self, src: str, dst: str) -> None:
        self.call(Op.COPY, a=src, b=dst)

    def scale(self, name: str, alpha: float) -> None:
        self.call(Op.SCALE, alpha, a=name)

    def diff(self, a: str, b: str, out: str) -> None:
        self.call(Op.DIFF, a=a, b=b, c=out)

    def keep_pair(self) -> None:
        self.call(Op.KEEP_PAIR)


class Unit(NamedTuple):
    """What a replica's worker is told: a unit of an evaluation, or goodbye (`bye`)."""

    unit: int
    evaluation: int
    bye: bool


class Report(NamedTuple):
    """A replica's report: its unit done and the unit's loss sum, or why it was lost."""

    replica: int
    unit: int
    evaluation: int
    loss_sum: float
    lost: str | None


class UnitChannel:
    """The coordinator's side of the units: it hands them to a replica's workers, and
    receives each replica's reports from its worker 0 on a thread of its own (a report, or
    the replica's loss when that receive fails, lands in one queue read with a deadline)."""

    def __init__(self, me: int, replica_ranks: list[list[int]]) -> None:
        self.me, self.replica_ranks = me, replica_ranks
        self.queue: queue.Queue[Report] = queue.Queue()
        for r, ranks in enumerate(replica_ranks):
            threading.Thread(
                target=self._listen, args=(r, ranks[0]), daemon=True, name=f"reports-{r}"
            ).start()

    def assign(self, replica: int, unit: int, evaluation: int, bye: bool = False) -> str | None:
        """Send a unit (or goodbye) to every worker of `replica`; why it failed, or None."""
        kind = Kind.BYE if bye else Kind.UNIT
        head = header(kind, self.me, 0, unit, 0, replica, evaluation)
        try:
            for k in self.replica_ranks[replica]:
                dist.send(head, k, tag=TAG_UNIT)
        except RuntimeError as exc:
            return transport_reason(exc)
        return None

    def _listen(self, replica: int, src: int) -> None:
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        value = torch.empty(1, dtype=torch.float64)
        try:
            while True:
                dist.recv(head, src=src, tag=TAG_DONE)
                dist.recv(value, src=src, tag=TAG_DONE_VALUE)
                _, _, _, unit, _, _, ev = head.tolist()
                self.queue.put(Report(replica, unit, ev, float(value[0]), None))
        except RuntimeError as exc:  # also when the replica ends after its goodbye: unread
            self.queue.put(Report(replica, -1, -1, 0.0, transport_reason(exc)))

    def next_report(self, timeout: float, busy: dict) -> Report:
        """The next report; RuntimeFailure after `timeout` seconds without one (`busy`: the
        replicas holding units, for the message)."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeFailure(
                f"no replica reported a work unit for {timeout:g} s "
                f"(replicas {sorted(busy)} hold units); raise --timeout if a unit takes longer"
            ) from None


def next_unit(coordinator: int) -> Unit:
    """A worker's side: the next unit (or goodbye) from the coordinator."""
    head = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(head, coordinator, tag=TAG_UNIT)
    kind, _, _, unit, _, _, ev = head.tolist()
    return Unit(unit, ev, kind == Kind.BYE)


def report_unit(coordinator: int, rank: int, replica: int, unit: Unit, loss_sum: float) -> None:
    """Worker 0 of a replica: `unit` is done, its loss summed over its examples."""
    done = header(Kind.DONE, rank, 0, unit.unit, 0, replica, unit.evaluation)
    dist.send(done, coordinator, tag=TAG_DONE)
    dist.send(torch.tensor([loss_sum], dtype=torch.float64), coordinator, tag=TAG_DONE_VALUE)
