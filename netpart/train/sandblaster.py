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
import queue
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from netpart import faults
from netpart.data import load_data
from netpart.errors import RuntimeFailure, transport_reason
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


def run_coordinator(
    config, placement: Placement, rank: int, run: Path, stop: threading.Event | None = None
) -> dict:
    """Drive L-BFGS for `config.steps` iterations (or until `stop` is set, at an iteration's
    end); returns the scheduling figures."""
    return Coordinator(config, placement, rank, run, stop).run()


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

    def release(self, replica: int, unit: int) -> bool:
        """`replica` no longer holds `unit` (it was lost): the unit is pending again unless it
        is done or another replica holds a copy; True if it was re-issued."""
        self.holders[unit].discard(replica)
        if unit in self.done or self.holders[unit] or unit in self.pending:
            return False
        self.pending.appendleft(unit)
        return True


class _Reports:
    """Unit reports, received by one thread per replica from its worker 0. A report, or the
    replica's loss when that receive fails (its worker 0 died, or ended after timing out on
    a dead mate), lands in one queue, which the coordinator reads with a deadline."""

    def __init__(self, placement: Placement, replicas: int) -> None:
        self.queue: queue.Queue = queue.Queue()
        for r in range(replicas):
            src = placement.worker_rank(r, 0)
            threading.Thread(
                target=self._listen, args=(r, src), daemon=True, name=f"reports-{r}"
            ).start()

    def _listen(self, replica: int, src: int) -> None:
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        value = torch.empty(1, dtype=torch.float64)
        try:
            while True:
                dist.recv(head, src=src, tag=TAG_DONE)
                dist.recv(value, src=src, tag=TAG_DONE_VALUE)
                _, _, _, unit, _, _, ev = head.tolist()
                self.queue.put((replica, unit, ev, float(value[0]), None))
        except RuntimeError as exc:  # also when the replica ends after its goodbye: unread
            self.queue.put((replica, -1, -1, 0.0, transport_reason(exc)))

    def next(self, timeout: float, busy: dict) -> tuple[int, int, int, float, str | None]:
        """(replica, unit, evaluation, loss sum, None) or (replica, .., why it was lost)."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeFailure(
                f"no replica reported a work unit for {timeout:g} s "
                f"(replicas {sorted(busy)} hold units); raise --timeout if a unit takes longer"
            ) from None


class Coordinator:
    """Sandblaster's coordinator: L-BFGS over the shards' vectors, work units to replicas.
    A replica lost while it holds a unit has the unit re-issued; nothing waits for ever."""

    def __init__(
        self, config, placement: Placement, rank: int, run: Path, stop: threading.Event | None
    ) -> None:
        self.config, self.placement, self.rank, self.stop = config, placement, rank, stop
        self.shards = RemoteShards([placement.shard_rank(s) for s in range(config.shards)], rank)
        self.reports = _Reports(placement, config.replicas)
        self.lost: set[int] = set()
        self.busy: dict[int, tuple[int, int, bool]] = {}  # replica -> (unit, evaluation, backup)
        self.stats = {"units_by_replica": [0] * config.replicas, "backups_sent": 0,
                      "backups_won": 0, "evaluations": 0, "reissued": 0, "redone": 0,
                      "lost_replicas": []}  # fmt: skip
        self.eval_id = 0
        self.t0 = time.time()
        self.metrics = (run / "sandblaster.jsonl").open("a")

    def run(self) -> dict:
        config = self.config
        driver = LBFGSDriver(
            self.shards, self.evaluate, lr=config.lr, history=config.history,
            line_search=None if config.line_search == "none" else "armijo",
            should_stop=None if self.stop is None else self.stop.is_set,
        )  # fmt: skip
        try:
            result = driver.run(config.steps)
        finally:
            self.metrics.close()
        while self.busy:  # replicas still on a unit report it before the goodbye (gloo sends
            r, *_, why = self.reports.next(config.timeout, self.busy)  # block until received)
            self.busy.pop(r, None)
            if why is not None:
                self._lose(r, why)
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
        """Loss and gradient at the shards' x over the batch, in work units; returns the loss.
        An evaluation a lost replica left incomplete at the shards is done again."""
        while True:
            loss = self._evaluate_once()
            missing = max(self.shards.call(Op.WAIT, float(self.config.units)))
            if not missing:
                break
            self.stats["redone"] += 1
            log.warning("evaluation %d: %d unit parts never reached the shards (a replica "
                        "was lost); evaluating again", self.eval_id, int(missing))  # fmt: skip
        self.stats["evaluations"] += 1
        line = {"evaluation": self.eval_id, "time": time.time(),
                "elapsed_s": time.time() - self.t0, "loss": loss, **self.stats}  # fmt: skip
        self.metrics.write(json.dumps(line) + "\n")
        self.metrics.flush()
        return loss

    def _evaluate_once(self) -> float:
        """Hand the units out until each is reported once; the loss they report."""
        self.eval_id += 1
        self.shards.call(Op.BEGIN, float(self.eval_id))
        ev = _Evaluation(self.config.units)
        replicas = range(self.config.replicas)
        free = collections.deque(r for r in replicas if r not in self.lost | set(self.busy))
        while len(ev.done) < self.config.units:
            self._hand_out(ev, free)
            if len(self.lost) == self.config.replicas:
                raise RuntimeFailure("every replica was lost")
            r, u, eval_id, loss_sum, why = self.reports.next(self.config.timeout, self.busy)
            if why is not None:
                self._lose(r, why, ev)
                continue
            _, _, backup = self.busy.pop(r, (u, eval_id, False))
            free.append(r)
            if eval_id == self.eval_id and u not in ev.done:
                ev.done[u] = loss_sum
                self.stats["units_by_replica"][r] += 1
                self.stats["backups_won"] += int(backup)
        return sum(ev.done.values()) / self.config.batch

    def _lose(self, replica: int, why: str, ev: _Evaluation | None = None) -> None:
        """`replica` is gone: forget it, and re-issue the unit it held."""
        if replica in self.lost:
            return
        self.lost.add(replica)
        self.stats["lost_replicas"].append(replica)
        unit, eval_id, _ = self.busy.pop(replica, (-1, -1, False))
        again = ev is not None and eval_id == self.eval_id and ev.release(replica, unit)
        self.stats["reissued"] += int(again)
        log.warning("replica %d lost (%s)%s", replica, why,
                    f"; unit {unit} goes to another replica" if again else "")  # fmt: skip

    def _hand_out(self, ev: _Evaluation, free: collections.deque) -> None:
        """Give every free replica a unit (or a backup copy) while there is one to give."""
        idle = []
        while free:
            r = free.popleft()
            if r in self.lost:
                continue
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
            self._lose(replica, transport_reason(exc))
            return False
        return True


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
