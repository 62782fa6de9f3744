"""Sandblaster L-BFGS across processes: a coordinator, the shards' vectors, work units.

The coordinator runs `LBFGSDriver` with `netpart.ps.commands.ShardCommands`: every vector
operation goes to every shard as a command and comes back as one float64 per shard, so no
parameter vector reaches the coordinator; the units and their reports travel through
`netpart.ps.commands` too (this module speaks no wire protocol of its own). An evaluation
of the loss and gradient at the shards' x is a batch of `--batch` examples (the same batch
every time: full-batch L-BFGS when it is the whole training set) cut into `--units` work
units:

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
import os
import threading
import time
from pathlib import Path

from netpart import faults
from netpart.errors import RuntimeFailure
from netpart.files import open_append
from netpart.models.reference import DTYPES
from netpart.ps.commands import ShardCommands, UnitChannel, next_unit, report_unit
from netpart.ps.protocol import Op
from netpart.train.lbfgs_driver import LBFGSDriver
from netpart.train.placement import Placement
from netpart.train.replica import ReplicaJob

__all__ = ["Coordinator", "run_coordinator", "run_unit_worker"]

log = logging.getLogger(__name__)


def _bounds(batch: int, units: int) -> list[int]:
    return [u * batch // units for u in range(units + 1)]


def run_coordinator(
    config, placement: Placement, rank: int, run: Path, stop: threading.Event | None = None
) -> dict:
    """Drive L-BFGS for `config.run.steps` iterations (or until `stop` is set, at an iteration's
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


class Coordinator:
    """Sandblaster's coordinator: L-BFGS over the shards' vectors, work units to replicas.
    A replica lost while it holds a unit has the unit re-issued; nothing waits for ever."""

    def __init__(
        self, config, placement: Placement, rank: int, run: Path, stop: threading.Event | None
    ) -> None:
        self.config, self.placement, self.rank, self.stop = config, placement, rank, stop
        self.shards = ShardCommands(
            [placement.shard_rank(s) for s in range(config.cluster.shards)], rank
        )
        ranks = [placement.replica_ranks(r) for r in range(config.cluster.replicas)]
        self.units = UnitChannel(rank, ranks)
        self.lost: set[int] = set()
        self.busy: dict[int, tuple[int, int, bool]] = {}  # replica -> (unit, evaluation, backup)
        self.stats = {
            "units_by_replica": [0] * config.cluster.replicas,
            "backups_sent": 0,
            "backups_won": 0,
            "evaluations": 0,
            "reissued": 0,
            "redone": 0,
            "lost_replicas": [],
        }
        self.eval_id = 0
        self.t0 = time.time()
        self.metrics = os.fdopen(open_append(run / "sandblaster.jsonl", lines=True), "a")

    def run(self) -> dict:
        config = self.config
        driver = LBFGSDriver(
            self.shards,
            self.evaluate,
            lr=config.optimiser.lr,
            history=config.optimiser.history,
            line_search=None if config.optimiser.line_search == "none" else "armijo",
            should_stop=None if self.stop is None else self.stop.is_set,
        )
        try:
            result = driver.run(config.run.steps)
        finally:
            self.metrics.close()
        while self.busy:  # replicas still on a unit report it before the goodbye (gloo sends
            r, *_, why = self.units.next_report(
                config.cluster.timeout, self.busy
            )  # block until received)
            self.busy.pop(r, None)
            if why is not None:
                self._lose(r, why)
        for r in range(config.cluster.replicas):
            if r not in self.lost:
                self._assign(r, bye=True)
        self.shards.call(Op.STOP)
        self.stats.update(
            iterations=result.iterations,
            stopped=result.stopped,
            losses=result.losses,
            coordinator_bytes_in=self.shards.bytes_in,
            coordinator_scalars=self.shards.scalars,
        )
        log.info(
            "L-BFGS: %d iterations, %d evaluations, stopped by %s; loss %.4g -> %.4g",
            result.iterations,
            result.evaluations,
            result.stopped,
            result.losses[0],
            result.losses[-1],
        )
        return self.stats

    def evaluate(self) -> float:
        """Loss and gradient at the shards' x over the batch, in work units; returns the loss.
        An evaluation a lost replica left incomplete at the shards is done again."""
        while True:
            loss = self._evaluate_once()
            missing = max(self.shards.call(Op.WAIT, float(self.config.optimiser.units)))
            if not missing:
                break
            self.stats["redone"] += 1
            log.warning(
                "evaluation %d: %d unit parts never reached the shards (a replica "
                "was lost); evaluating again",
                self.eval_id,
                int(missing),
            )
        self.stats["evaluations"] += 1
        line = {
            "evaluation": self.eval_id,
            "time": time.time(),
            "elapsed_s": time.time() - self.t0,
            "loss": loss,
            **self.stats,
        }
        self.metrics.write(json.dumps(line) + "\n")
        self.metrics.flush()
        return loss

    def _evaluate_once(self) -> float:
        """Hand the units out until each is reported once; the loss they report."""
        self.eval_id += 1
        self.shards.call(Op.BEGIN, float(self.eval_id))
        ev = _Evaluation(self.config.optimiser.units)
        replicas = range(self.config.cluster.replicas)
        free = collections.deque(r for r in replicas if r not in self.lost | set(self.busy))
        while len(ev.done) < self.config.optimiser.units:
            self._hand_out(ev, free)
            if len(self.lost) == self.config.cluster.replicas:
                raise RuntimeFailure("every replica was lost")
            r, u, eval_id, loss_sum, why = self.units.next_report(
                self.config.cluster.timeout, self.busy
            )
            if why is not None:
                self._lose(r, why, ev)
                continue
            _, _, backup = self.busy.pop(r, (u, eval_id, False))
            free.append(r)
            if eval_id == self.eval_id and u not in ev.done:
                ev.done[u] = loss_sum
                self.stats["units_by_replica"][r] += 1
                self.stats["backups_won"] += int(backup)
        return sum(ev.done.values()) / self.config.data.batch

    def _lose(self, replica: int, why: str, ev: _Evaluation | None = None) -> None:
        """`replica` is gone: forget it, and re-issue the unit it held."""
        if replica in self.lost:
            return
        self.lost.add(replica)
        self.stats["lost_replicas"].append(replica)
        unit, eval_id, _ = self.busy.pop(replica, (-1, -1, False))
        again = ev is not None and eval_id == self.eval_id and ev.release(replica, unit)
        self.stats["reissued"] += int(again)
        log.warning(
            "replica %d lost (%s)%s",
            replica,
            why,
            f"; unit {unit} goes to another replica" if again else "",
        )

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
            if self._assign(r, u):
                ev.holders[u].add(r)
                self.busy[r] = (u, self.eval_id, backup)
                ev.first_sent.setdefault(u, time.monotonic())
            elif not backup:
                ev.pending.appendleft(u)
        free.extend(idle)

    def _assign(self, replica: int, unit: int = 0, bye: bool = False) -> bool:
        """Send a unit (or goodbye) to every worker of `replica`; False if it is lost."""
        why = self.units.assign(replica, unit, self.eval_id, bye=bye)
        if why is not None:
            self._lose(replica, why)
        return why is None


def run_unit_worker(job: ReplicaJob) -> None:
    """Worker loop: receive units, fetch once per evaluation, push each unit's gradient."""
    config, replica, worker, rank = job.config, job.replica, job.worker, job.rank
    model, transport, client = job.build()
    load = model.bind_values  # the parameters become views of the fetched values
    data = config.dataset(job.spec)
    ids = data.indices(0, 1, 1, config.data.batch)  # the batch every evaluation works on
    bounds = _bounds(config.data.batch, config.optimiser.units)
    coordinator = job.placement.coordinator_rank()
    fetched, done_units = None, 0
    while not (got := next_unit(coordinator)).bye:
        unit, ev = got.unit, got.evaluation
        if ev != fetched:
            load(client.complete(client.request(0, fetch=True)))
            fetched = ev
        faults.point(rank, done_units)  # test hook: a slow replica sleeps here
        done_units += 1
        part = ids[bounds[unit] : bounds[unit + 1]]
        x, y = data.examples(part, DTYPES[config.run.dtype])
        model.zero_grad()
        result = model.step(x, y, transport, collect_grads=False)
        push = client.request(unit, model.flat_grads() * (len(part) / config.data.batch), extra=ev)
        if worker == 0:
            report_unit(coordinator, rank, replica, got, result.loss * len(part))
        client.complete(push)
    client.close()
