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
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.data import load_data
from netpart.runtime.lbfgs import LBFGSDriver, name_code
from netpart.runtime.placement import Placement
from netpart.runtime.ps import HEADER_LEN, Kind, Op, _header
from netpart.runtime.ps_client import ShardClient
from netpart.runtime.transport import GlooTransport

__all__ = ["RemoteShards", "run_coordinator", "run_worker"]

log = logging.getLogger(__name__)

TAG_HEADER, TAG_PAYLOAD = 1, 2  # commands and replies (as the parameter-server messages)
TAG_UNIT, TAG_DONE, TAG_DONE_VALUE = 40, 41, 42


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
            headers.append(_header(Kind.CMD, self.me, s, int(op), 4, 0))
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
    shards = RemoteShards([placement.shard_rank(s) for s in range(config.shards)], rank)
    replicas, units = config.replicas, config.units
    lost: set[int] = set()
    busy: dict[int, tuple[int, int, bool]] = {}  # replica -> (unit, evaluation, backup)
    stats = {"units_by_replica": [0] * replicas, "backups_sent": 0, "backups_won": 0,
             "evaluations": 0}  # fmt: skip
    eval_id = [0]
    t0 = time.time()
    metrics = (run / "sandblaster.jsonl").open("a")

    def assign(r: int, kind: Kind, unit: int = 0) -> bool:
        hdr = _header(kind, rank, 0, unit, 0, r, eval_id[0])
        try:
            for k in placement.replica_ranks(r):
                dist.send(hdr, k, tag=TAG_UNIT)
        except RuntimeError as exc:
            log.warning("replica %d lost: %s", r, exc)
            lost.add(r)
            return False
        return True

    def receive_done() -> tuple[int, int, int, float]:
        """The next unit report, from any replica (blocking; a slow replica's units are
        covered by backup copies meanwhile)."""
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
        value = torch.empty(1, dtype=torch.float64)
        src = dist.recv(hdr, tag=TAG_DONE)
        dist.recv(value, src=src, tag=TAG_DONE_VALUE)
        _, _, _, unit, _, replica, ev = hdr.tolist()
        return replica, unit, ev, float(value[0])

    def evaluate() -> float:
        eval_id[0] += 1
        shards.call(Op.BEGIN, float(eval_id[0]))
        pending = collections.deque(range(units))
        done: dict[int, float] = {}
        first_sent: dict[int, float] = {}
        holders: dict[int, set[int]] = collections.defaultdict(set)
        free = collections.deque(r for r in range(replicas) if r not in lost and r not in busy)
        while len(done) < units:
            idle = []
            while free:
                r = free.popleft()
                if pending:
                    u, backup = pending.popleft(), False
                else:
                    open_units = [u for u in first_sent if u not in done and r not in holders[u]]
                    if not open_units:
                        idle.append(r)
                        continue
                    u, backup = min(open_units, key=first_sent.get), True
                    stats["backups_sent"] += 1
                if assign(r, Kind.UNIT, u):
                    holders[u].add(r)
                    busy[r] = (u, eval_id[0], backup)
                    first_sent.setdefault(u, time.monotonic())
                elif not backup:
                    pending.appendleft(u)
            free.extend(idle)
            if len(lost) == replicas:
                raise RuntimeError("every replica was lost")
            r, u, ev, loss_sum = receive_done()
            _, _, backup = busy.pop(r, (u, ev, False))
            free.append(r)
            if ev == eval_id[0] and u not in done:
                done[u] = loss_sum
                stats["units_by_replica"][r] += 1
                stats["backups_won"] += int(backup)
        shards.call(Op.WAIT, float(units))
        stats["evaluations"] += 1
        loss = sum(done.values()) / config.batch
        line = {"evaluation": eval_id[0], "time": time.time(), "elapsed_s": time.time() - t0,
                "loss": loss, **stats}  # fmt: skip
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()
        return loss

    driver = LBFGSDriver(
        shards, evaluate, lr=config.lr, history=config.history,
        line_search=None if config.line_search == "none" else "armijo",
    )  # fmt: skip
    try:
        result = driver.run(config.steps)
    finally:
        metrics.close()
    while busy:  # replicas still on a unit report it before the goodbye (gloo sends block
        r, *_ = receive_done()  # until received); a replica that died is not handled here
        busy.pop(r, None)
    for r in range(replicas):
        if r not in lost:
            assign(r, Kind.BYE)
    shards.call(Op.STOP)
    stats.update(iterations=result.iterations, stopped=result.stopped,
                 losses=result.losses, coordinator_bytes_in=shards.bytes_in,
                 coordinator_scalars=shards.scalars)  # fmt: skip
    log.info("L-BFGS: %d iterations, %d evaluations, stopped by %s; loss %.4g -> %.4g",
             result.iterations, result.evaluations, result.stopped, result.losses[0],
             result.losses[-1])  # fmt: skip
    return stats


def run_worker(
    spec, model, tensors, layout, config, replica, worker, rank, group, placement, flat_grads,
    load,
) -> None:  # fmt: skip
    """Worker loop: receive units, fetch once per evaluation, push each unit's gradient."""
    dtype = next(iter(tensors)).dtype
    transport = GlooTransport(group, ranks=placement.replica_ranks(replica))
    shard_ranks = [placement.shard_rank(s) for s in range(config.shards)]
    client = ShardClient(layout, worker, replica, rank, shard_ranks, dtype)
    data = load_data(config.data, spec, config.seed, config.examples)
    ids = data.indices(0, 1, 1, config.batch)  # the batch every evaluation works on
    bounds = _bounds(config.batch, config.units)
    coordinator = placement.coordinator_rank()
    slow = _slowness(replica)
    hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
    fetched = None
    while True:
        dist.recv(hdr, coordinator, tag=TAG_UNIT)
        kind, _, _, unit, _, _, ev = hdr.tolist()
        if kind == Kind.BYE:
            break
        if ev != fetched:
            client.fetch()
            load(tensors, client.take(wait=True))
            fetched = ev
        if slow:
            time.sleep(slow)
        part = ids[bounds[unit] : bounds[unit + 1]]
        x, y = data.examples(part, dtype)
        model.zero_grad()
        result = model.step(x, y, transport, collect_grads=False)
        client.push(flat_grads(tensors) * (len(part) / config.batch), unit, extra=ev)
        if worker == 0:
            done = _header(Kind.DONE, rank, 0, unit, 0, replica, ev)
            dist.send(done, coordinator, tag=TAG_DONE)
            value = torch.tensor([result.loss * len(part)], dtype=torch.float64)
            dist.send(value, coordinator, tag=TAG_DONE_VALUE)
    client.close()


def _slowness(replica: int) -> float:
    """Test hook: NETPART_TEST_SLOW=R:SECONDS makes replica R sleep that long per unit."""
    who, _, seconds = os.environ.get("NETPART_TEST_SLOW", "").partition(":")
    return float(seconds) if who and int(who) == replica else 0.0
