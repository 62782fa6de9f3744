"""Calibration across the hosts of a torchrun job: the link and the steps between machines.

`netpart calibrate` started by torchrun with one process per host measures the network
between the hosts, not loopback: every process joins one gloo group; rank 0 runs
`calibrate` with a `HostsRunner` and every other rank `follow`s it. Rank 0 times the slices
on its own host (the hosts are taken to be alike) while the others wait; for the link and
for every step measurement it broadcasts a command (JSON bytes, never a pickle), and the
ranks the command names run the runtime's own link loop or worker steps, one worker per
host, with layers split as across machines. Each result is reduced to rank 0 (the slowest
process), and rank 0 writes the profile. Commands wait at most COMMAND_WAIT_S; everything
else at most the job's timeout, and a lost peer ends every rank with one line.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import itertools
import json
import logging

import numpy as np
import torch
import torch.distributed as dist

from netpart import faults
from netpart.calibrate.measure import LocalRunner, step_cpu_s
from netpart.calibrate.ring import Tables, rings
from netpart.compile.schedule import SPLIT_MIN_FLOPS, plan_schedule
from netpart.cost.exchange import PS_MODES
from netpart.errors import NetpartError, PeerError, ProtocolError, transport_reason
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan
from netpart.processes.groups import new_groups
from netpart.processes.launcher import gloo_io_threads, join_group, yield_io_threads
from netpart.ps.timed_exchange import ps_loop, stand_in
from netpart.runtime.check import make_batch
from netpart.runtime.step import exchange_loop, link_loop, step_loop, warmup_steps
from netpart.runtime.transport import PEER_LOST, GlooTransport
from netpart.runtime.worker import ModelWorker

__all__ = ["COMMAND_WAIT_S", "HostsRunner", "read_ring_plan"]

log = logging.getLogger(__name__)

COMMAND_WAIT_S = 1800.0  # a follower waits this long at most for rank 0's next command
OPS = ("plan", "link", "ps", "step", "done")
PLAN_KEYS = ("sizes", "repeats")  # of the all-reduce a done command asks for
MAX_STAND_IN_S = 2.0  # CPU seconds, of a ps command's stand-in step
MAX_COMMAND = 1 << 30  # bytes: a plan command holds a node map, never more than this


class _Commands:
    """JSON documents from rank 0 to every rank: a length, then the bytes (no pickle)."""

    def __init__(self, group: dist.ProcessGroup, rank: int):
        self.group, self.rank = group, rank

    def send(self, doc: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        self._broadcast(data)

    def receive(self) -> dict:
        size = self._broadcast(torch.zeros(1, dtype=torch.int64))
        if not 0 <= int(size[0]) <= MAX_COMMAND:
            raise ProtocolError(
                f"calibration rank {self.rank}: rank 0 announced a command of {int(size[0])} bytes"
            )
        data = self._broadcast(torch.empty(int(size[0]), dtype=torch.uint8))
        try:
            doc = json.loads(data.numpy().tobytes().decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(
                f"calibration rank {self.rank}: rank 0 sent a malformed command ({exc})"
            ) from None
        if not isinstance(doc, dict) or doc.get("op") not in OPS:
            raise ProtocolError(
                f"calibration rank {self.rank}: not a calibration command from "
                f"rank 0: {str(doc)[:80]}"
            )
        return doc

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            dist.broadcast(tensor, 0, group=self.group)
        except RuntimeError as exc:
            raise PeerError(
                f"calibration rank {self.rank}: a command from rank 0 failed ({PEER_LOST}): "
                f"{transport_reason(exc)}"
            ) from None
        return tensor


class HostsRunner:
    """`netpart.calibrate.measure.Runner` over the processes of a torchrun job, one per host:
    `machines` is the job's world size; a step of an N-worker plan runs on ranks 0..N-1 (N
    at most the world), a link among `world` on ranks 0..world-1. Built on every rank
    (it joins the group); rank 0 measures, the others call `follow` until rank 0 `close`s."""

    overlap = True  # workers on different hosts hide halo behind interior compute
    probe_beside = False  # rank 0 is a worker of every step

    def __init__(self, timeout: float = 120.0, share: float = 1.0):
        self.share = share  # of a core, each host's (a cpu quota): slices count CPU / share
        self._timeout = timeout
        self.rank, self.machines = join_group(timeout)
        torch.set_num_threads(1)  # as every worker process
        # Every rank creates every group, members or not, in the same order.
        sizes = range(1, self.machines + 1)
        groups = new_groups([list(range(k)) for k in sizes], timeout=dist.default_pg_timeout)
        self._groups = dict(zip(sizes, groups, strict=True))
        wait = datetime.timedelta(seconds=COMMAND_WAIT_S)
        (group,) = new_groups([list(range(self.machines))], timeout=wait)
        self._commands = _Commands(group, self.rank)
        yield_io_threads()  # the new groups' I/O threads too, as the workers' (launcher)
        self._plans: dict[str, tuple[ModelSpec, PartitionPlan]] = {}

    # rank 0: the Runner protocol
    def slices(self, spec: ModelSpec, plans: list[PartitionPlan], batch: int) -> list:
        return LocalRunner(self.share).slices(spec, plans, batch)

    def link(self, sizes: tuple[int, ...], repeats: int, world: int) -> tuple[np.ndarray, float]:
        cmd = {"op": "link", "world": world, "sizes": [int(b) for b in sizes], "repeats": repeats}
        self._commands.send(cmd)
        return self._link(cmd)

    def ps(
        self,
        mode: str,
        clients: int,
        sizes: tuple[int, ...],
        repeats: int,
        shards: int = 1,
        stand_in: float = 0.0,
    ):
        """(seconds, CPU seconds) per exchange of the parameter server's clients, each size
        (`netpart.ps.timed_exchange`): `clients` ranks and `shards` shards on the next; `stand_in`
        (> 0): each client runs a step of that much CPU before each request. The all-reduce
        is timed after the group is left (`close`)."""
        cmd = {
            "op": "ps",
            "mode": mode,
            "clients": clients,
            "sizes": [int(b) for b in sizes],
            "repeats": repeats,
            "shards": shards,
            "stand_in": float(stand_in),
        }
        self._commands.send(cmd)
        return self._ps(cmd)

    def step(self, spec, p, batch, steps, exchange_only=False) -> tuple[float, float]:
        key = _key(spec, p)
        if key not in self._plans:
            self._commands.send(
                {
                    "op": "plan",
                    "key": key,
                    "spec": spec.to_json(),
                    "plan": p.to_json(),
                    "node_map": p.node_map.tolist(),
                }
            )
            self._plans[key] = (spec, p)
        cmd = {
            "op": "step",
            "key": key,
            "batch": batch,
            "steps": steps,
            "exchange_only": exchange_only,
        }
        self._commands.send(cmd)
        return self._step(cmd)

    def close(self, ring: dict | None = None) -> Tables:
        """Rank 0: release the followers and leave the group; with `ring` ({"sizes": [...],
        "repeats": [...]}, one count per size), every rank then times the all-reduce among 2
        to all machines (`netpart.calibrate.ring.rings`): the slowest rank's tables."""
        try:
            self._commands.send({"op": "done", "ring": ring})
        finally:
            self._leave()
        return self._rings(ring)

    # every other rank
    def follow(self) -> None:
        """Run rank 0's commands until it is done; then leave the group, and time the
        all-reduce if rank 0 says so (`close`)."""
        try:
            for n in itertools.count():
                faults.point(self.rank, n)
                if (cmd := self._commands.receive())["op"] == "done":
                    ring = read_ring_plan(cmd.get("ring"), self.rank)
                    break
                try:
                    self._obey(cmd)
                except (KeyError, TypeError, ValueError, NetpartError) as exc:
                    raise ProtocolError(
                        f"calibration rank {self.rank}: rank 0's {cmd['op']} "
                        f"command does not hold what it must ({exc!r})"
                    ) from None
        finally:
            self._leave()
        self._rings(ring)

    def _leave(self) -> None:
        """Leave every group and let go of it: a gloo group's I/O thread, which wakes 100
        times a second, runs for as long as anything holds the group, destroyed or not."""
        dist.destroy_process_group()
        self._groups.clear()
        self._commands = None
        gc.collect()
        if awake := gloo_io_threads():
            log.warning(
                "calibration rank %d: %d gloo I/O threads still run beside the "
                "all-reduce: it may read fast",
                self.rank,
                len(awake),
            )

    def _rings(self, ring: dict | None) -> Tables:
        if ring is None:
            return {}
        return rings(self.rank, self.machines, ring["sizes"], ring["repeats"], self._timeout)

    def _obey(self, cmd: dict) -> None:
        if cmd["op"] == "plan":
            spec = ModelSpec.from_json(cmd["spec"], "rank 0's command")
            node_map = np.array(cmd["node_map"], dtype=np.int64)
            p = PartitionPlan.from_json(cmd["plan"], node_map, "rank 0's command")
            self._plans[cmd["key"]] = (spec, p)
        elif cmd["op"] == "link":
            self._link(cmd)
        elif cmd["op"] == "ps":
            self._ps(cmd)
        else:
            self._step(cmd)

    # what every rank a command names runs
    def _link(self, cmd: dict) -> tuple[np.ndarray, float]:
        world = int(cmd["world"])
        if self.rank >= world:
            return np.zeros(0), 0.0
        transport = GlooTransport(self._groups[world], list(range(world)))
        seconds, gather = link_loop(transport, cmd["sizes"], int(cmd["repeats"]))
        slowest = transport.all_reduce(torch.tensor([*seconds, gather], dtype=torch.float64), "max")
        return slowest[:-1].numpy(), float(slowest[-1])

    def _ps(self, cmd: dict) -> tuple[np.ndarray, np.ndarray]:
        clients, shards = int(cmd["clients"]), int(cmd["shards"])
        world = clients + shards
        if self.rank >= world:
            return np.zeros(0), np.zeros(0)
        if cmd["mode"] not in PS_MODES or clients < 1 or shards < 1 or world > self.machines:
            raise ValueError(f"mode {cmd['mode']!r}, {clients} clients, {shards} shards")
        group, repeats, cpu_s = self._groups[world], int(cmd["repeats"]), cmd.get("stand_in", 0)
        if not isinstance(cpu_s, int | float) or not 0 <= cpu_s <= MAX_STAND_IN_S:
            raise ValueError(f"stand_in {cpu_s!r}: 0 to {MAX_STAND_IN_S} CPU seconds")
        seconds, cpu = [], []
        for size in cmd["sizes"]:  # a loop a size: a stand-in writes that size's gradients
            beside = stand_in(cpu_s, int(size) // 4) if cpu_s else None
            t, c = ps_loop(
                group, self.rank, cmd["mode"], [size], repeats, shards=shards, beside=beside
            )
            seconds += t
            cpu += c
        slowest = torch.tensor([*seconds, *cpu], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        n = len(seconds)
        return slowest[:n].numpy(), slowest[n:].numpy()

    def _step(self, cmd: dict) -> tuple[float, float]:
        """(median step, slowest worker; CPU seconds a step on the busiest worker, all
        threads) of the command's plan on ranks 0..N-1, after warm-up steps."""
        spec, p = self._plans[cmd["key"]]
        if self.rank >= p.workers:
            return 0.0, 0.0
        graph, schedule = plan_schedule(spec, p, split_min_flops=SPLIT_MIN_FLOPS)
        worker = ModelWorker(spec, graph, schedule, self.rank, seed=0, dtype=torch.float32)
        x, y = make_batch(spec, int(cmd["batch"]), 0)
        transport = GlooTransport(self._groups[p.workers], list(range(p.workers)))
        warm = warmup_steps(int(cmd["steps"]))
        total = int(cmd["steps"]) + warm
        if cmd["exchange_only"]:
            times, cpu = exchange_loop(worker, transport, len(x), total), 0.0
        else:
            batch = {"inputs": x.float(), "targets": y}
            result, _, usage = step_loop(worker, transport, batch, total)
            times, cpu = result.step_times, step_cpu_s([usage], warm)
        mine = torch.tensor([*times[warm:], cpu], dtype=torch.float64)
        slowest = transport.all_reduce(mine, "max")
        return float(np.median(slowest[:-1].numpy())), float(slowest[-1])


def _key(spec: ModelSpec, p: PartitionPlan) -> str:
    """The same model and plan get the same key: their followers build them once."""
    digest = hashlib.sha256(spec.to_json().encode() + p.to_json().encode())
    digest.update(np.ascontiguousarray(p.node_map, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def read_ring_plan(ring, rank: int) -> dict | None:
    """The all-reduce rank 0's `done` command asks for: None, or sizes and a count of each
    (ProtocolError if it is neither)."""
    if ring is None:
        return None
    lists = isinstance(ring, dict) and all(isinstance(ring.get(k), list) for k in PLAN_KEYS)
    ok = (
        lists
        and ring["sizes"]
        and len(ring["sizes"]) == len(ring["repeats"])
        and all(isinstance(v, int) and v > 0 for v in ring["sizes"] + ring["repeats"])
    )
    if not ok:
        raise ProtocolError(
            f"calibration rank {rank}: rank 0's done command names no "
            f"all-reduce to time: {str(ring)[:80]}"
        )
    return {"sizes": ring["sizes"], "repeats": ring["repeats"]}
