"""Sandblaster L-BFGS across processes: a coordinator, the shards' vectors, work units.

The coordinator runs `LBFGSDriver` with `RemoteShards`: every vector operation goes to every
shard as a command (`Kind.CMD`) and comes back as one float64 per shard, so no parameter
vector reaches the coordinator. An evaluation of the loss and gradient at the shards' x is a
batch of `--batch` examples (the same batch every time: full-batch L-BFGS when it is the
whole training set) cut into `--units` work units:

- the coordinator hands units to replicas as they become free, so a fast replica does more;
- once every unit is handed out, a replica that becomes free gets a backup copy of the
  oldest unfinished unit; whichever copy finishes first counts;
- a replica fetches the parameters once per evaluation, then pushes each unit's gradient
  (scaled by its share of the batch) to the shards, which add it to the batch gradient
  once per (unit, worker part), dropping the slower copy;
- worker 0 of the replica reports the unit's loss sum to the coordinator, which then asks
  the shards to confirm every part arrived before the next vector operation.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from netpart import faults
from netpart.data import load_data
from netpart.ps.lbfgs import name_code
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
from netpart.train.lbfgs import LBFGSDriver
from netpart.train.placement import Placement
from netpart.train.replica import DTYPES, ReplicaJob

__all__ = ["Coordinator", "RemoteShards", "run_coordinator", "run_unit_worker"]

log = logging.getLogger(__name__)


class RemoteShards:
    """The driver's view of the shard processes: one command to each, one float back."""

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


def _bounds(batch: int, units: int) -> list[int]:
    return [u * batch // units for u in range(units + 1)]


def run_coordinator(config, placement: Placement, rank: int, run: Path) -> dict:
    """Drive L-BFGS for `config.steps` iterations; returns the scheduling figures."""
    return Coordinator(config, placement, rank, run).run()


class _Evaluation:
    """One evaluation's work units: which are pending, done, and held by whom."""

    def __init__(self, units: int) -> None:
        self.pending = collections.deque(range(units))
        self.done: dict[int, float] = {}  # unit -> loss sum
        self.first_sent: dict[int, float] = {}
        self.holders: dict[int, set[int]] = collections.defaultdict(set)

    def next_for(self, replica: int) -> tuple[int, bool] | None:
        """(unit, is a backup copy) for a free replica, or None: a pending unit first, else a
        backup of the oldest unfinished unit it does not hold already."""
        if self.pending:
            return self.pending.popleft(), False
        open_units = [
            u for u in self.first_sent if u not in self.done and replica not in self.holders[u]
        ]
        if not open_units:
            return None
        return min(open_units, key=self.first_sent.get), True


class Coordinator:
    """Sandblaster's coordinator: L-BFGS over the shards' vectors, work units to replicas."""

    def __init__(self, config, placement: Placement, rank: int, run: Path) -> None:
        self.config, self.placement, self.rank = config, placement, rank
        self.shards = RemoteShards([placement.shard_rank(s) for s in range(config.shards)], rank)
        self.lost: set[int] = set()
        self.busy: dict[int, tuple[int, int, bool]] = {}  # replica -> (unit, evaluation, backup)
        self.stats = {"units_by_replica": [0] * config.replicas, "backups_sent": 0,
                      "backups_won": 0, "evaluations": 0}  # fmt: skip
        self.eval_id = 0
        self.t0 = time.time()
        self.metrics = (run / "sandblaster.jsonl").open("a")

    def run(self) -> dict:
        config = self.config
        driver = LBFGSDriver(
            self.shards, self.evaluate, lr=config.lr, history=config.history,
            line_search=None if config.line_search == "none" else "armijo",
        )  # fmt: skip
        try:
            result = driver.run(config.steps)
        finally:
            self.metrics.close()
        while self.busy:  # replicas still on a unit report it before the goodbye (gloo sends
            r, *_ = self._receive_done()  # block until received)
            self.busy.pop(r, None)
        for r in range(config.replicas):
            if r not in self.lost:
                self._assign(r, Kind.BYE)
        self.shards.call(Op.STOP)
        self.stats.update(
            iterations=result.iterations, stopped=result.stopped, losses=result.losses,
            coordinator_bytes_in=self.shards.bytes_in, coordinator_scalars=self.shards.scalars,
        )  # fmt: skip
        log.info("L-BFGS: %d iterations, %d evaluations, stopped by %s; loss %.4g -> %.4g",
                 result.iterations, result.evaluations, result.stopped, result.losses[0],
                 result.losses[-1])  # fmt: skip
        return self.stats

    def evaluate(self) -> float:
        """Loss and gradient at the shards' x over the batch, in work units; returns the loss."""
        self.eval_id += 1
        self.shards.call(Op.BEGIN, float(self.eval_id))
        ev = _Evaluation(self.config.units)
        replicas = range(self.config.replicas)
        free = collections.deque(r for r in replicas if r not in self.lost | set(self.busy))
        while len(ev.done) < self.config.units:
            self._hand_out(ev, free)
            if len(self.lost) == self.config.replicas:
                raise RuntimeError("every replica was lost")
            r, u, eval_id, loss_sum = self._receive_done()
            _, _, backup = self.busy.pop(r, (u, eval_id, False))
            free.append(r)
            if eval_id == self.eval_id and u not in ev.done:
                ev.done[u] = loss_sum
                self.stats["units_by_replica"][r] += 1
                self.stats["backups_won"] += int(backup)
        self.shards.call(Op.WAIT, float(self.config.units))
        self.stats["evaluations"] += 1
        loss = sum(ev.done.values()) / self.config.batch
        line = {"evaluation": self.eval_id, "time": time.time(),
                "elapsed_s": time.time() - self.t0, "loss": loss, **self.stats}  # fmt: skip
        self.metrics.write(json.dumps(line) + "\n")
        self.metrics.flush()
        return loss

    def _hand_out(self, ev: _Evaluation, free: collections.deque) -> None:
        """Give every free replica a unit (or a backup copy) while there is one to give."""
        idle = []
        while free:
            r = free.popleft()
            choice = ev.next_for(r)
            if choice is None:
                idle.append(r)
                continue
            u, backup = choice
            self.stats["backups_sent"] += int(backup)
            if self._assign(r, Kind.UNIT, u):
                ev.holders[u].add(r)
                self.busy[r] = (u, self.eval_id, backup)
                ev.first_sent.setdefault(u, time.monotonic())
            elif not backup:
                ev.pending.appendleft(u)
        free.extend(idle)

    def _assign(self, replica: int, kind: Kind, unit: int = 0) -> bool:
        """Send a unit (or goodbye) to every worker of `replica`; False if it is lost."""
        head = header(kind, self.rank, 0, unit, 0, replica, self.eval_id)
        try:
            for k in self.placement.replica_ranks(replica):
                dist.send(head, k, tag=TAG_UNIT)
        except RuntimeError as exc:
            log.warning("replica %d lost: %s", replica, exc)
            self.lost.add(replica)
            return False
        return True

    def _receive_done(self) -> tuple[int, int, int, float]:
        """The next unit report, from any replica (blocking; a slow replica's units are
        covered by backup copies meanwhile)."""
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        value = torch.empty(1, dtype=torch.float64)
        src = dist.recv(head, tag=TAG_DONE)
        dist.recv(value, src=src, tag=TAG_DONE_VALUE)
        _, _, _, unit, _, replica, ev = head.tolist()
        return replica, unit, ev, float(value[0])


def run_unit_worker(job: ReplicaJob) -> None:
    """Worker loop: receive units, fetch once per evaluation, push each unit's gradient."""
    config, replica, worker, rank = job.config, job.replica, job.worker, job.rank
    model, transport, client = job.build()
    load = model.bind_values  # the parameters become views of the fetched values
    data = load_data(config.data, job.spec, config.seed, config.examples)
    ids = data.indices(0, 1, 1, config.batch)  # the batch every evaluation works on
    bounds = _bounds(config.batch, config.units)
    coordinator = job.placement.coordinator_rank()
    head = torch.empty(HEADER_LEN, dtype=torch.int64)
    fetched, done_units = None, 0
    while True:
        dist.recv(head, coordinator, tag=TAG_UNIT)
        kind, _, _, unit, _, _, ev = head.tolist()
        if kind == Kind.BYE:
            break
        if ev != fetched:
            load(client.complete(client.request(0, fetch=True)))
            fetched = ev
        faults.point(rank, done_units)  # test hook: a slow replica sleeps here
        done_units += 1
        part = ids[bounds[unit] : bounds[unit + 1]]
        x, y = data.examples(part, DTYPES[config.dtype])
        model.zero_grad()
        result = model.step(x, y, transport, collect_grads=False)
        push = client.request(unit, model.flat_grads() * (len(part) / config.batch), extra=ev)
        if worker == 0:
            done = header(Kind.DONE, rank, 0, unit, 0, replica, ev)
            dist.send(done, coordinator, tag=TAG_DONE)
            value = torch.tensor([result.loss * len(part)], dtype=torch.float64)
            dist.send(value, coordinator, tag=TAG_DONE_VALUE)
        client.complete(push)
    client.close()
