"""Placement: which rank of a training job plays which role, given the host of every rank.

A job has R x N model workers and S shards. torchrun numbers the ranks (each node gets a
contiguous block); the placement maps ranks to roles, a pure function of the hosts:

- `pack` (default): each replica's N workers go to as few hosts as possible (first the host
  whose free slots fit the replica most tightly; a replica larger than any host is split over
  the hosts with most room), so halo traffic stays inside a machine; shards then take the
  remaining slots, spread round-robin over the hosts so no single link carries every push;
- `spread`: worker w of every replica on host w mod K (halo crosses machines: for experiments);
- `ordered`: rank r*N + w is worker w of replica r, rank R*N + s is shard s (the arithmetic
  of a single machine, where every policy gives this order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from netpart.errors import PlacementError

__all__ = [
    "COORDINATOR",
    "POLICIES",
    "SHARD",
    "WORKER",
    "Placement",
    "PlacementError",
    "Role",
    "place",
]

POLICIES = ("pack", "spread", "ordered")
WORKER, SHARD, COORDINATOR = "worker", "shard", "coordinator"


@dataclass(frozen=True)
class Role:
    """What a rank plays: model worker `worker` of replica `replica`, parameter-server shard
    `shard`, or Sandblaster's coordinator."""

    kind: str  # WORKER | SHARD | COORDINATOR
    replica: int = -1
    worker: int = -1
    shard: int = -1

    def __str__(self) -> str:
        """How logs name it: 'replica 1 worker 0', 'shard 2' or 'coordinator'."""
        if self.kind == WORKER:
            return f"replica {self.replica} worker {self.worker}"
        return f"shard {self.shard}" if self.kind == SHARD else COORDINATOR


@dataclass(frozen=True)
class Placement:
    """roles[rank]: the `Role` rank plays; hosts[rank]: its host."""

    replicas: int
    workers: int
    shards: int
    roles: tuple[Role, ...]
    hosts: tuple[str, ...]

    def worker_rank(self, replica: int, worker: int) -> int:
        return self._index[Role(WORKER, replica=replica, worker=worker)]

    def shard_rank(self, shard: int) -> int:
        return self._index[Role(SHARD, shard=shard)]

    def coordinator_rank(self) -> int:
        return self._index[Role(COORDINATOR)]

    def replica_ranks(self, replica: int) -> list[int]:
        """Global ranks of replica `replica`'s workers, in worker order."""
        return [self.worker_rank(replica, w) for w in range(self.workers)]

    def name(self, rank: int) -> str:
        """How logs name a rank: 'replica 1 worker 0', 'shard 2' or 'coordinator'."""
        return str(self.roles[rank])

    def hosts_of_replica(self, replica: int) -> set[str]:
        return {self.hosts[k] for k in self.replica_ranks(replica)}

    @cached_property
    def _index(self) -> dict[Role, int]:
        return {role: k for k, role in enumerate(self.roles)}

    def to_dict(self) -> dict:
        return {
            "ranks": [
                {"rank": k, "host": h, "role": self.name(k)} for k, h in enumerate(self.hosts)
            ]
        }


def place(
    hosts: Sequence[str],
    replicas: int,
    workers: int,
    shards: int,
    policy: str = "pack",
    coordinators: int = 0,
) -> Placement:
    """The placement of a job whose rank k runs on `hosts[k]` (see the module docstring); a
    Sandblaster coordinator, if any, takes the last free slot."""
    world = replicas * workers + shards + coordinators
    if len(hosts) != world:
        raise PlacementError(
            f"{len(hosts)} processes for a job of {replicas} x {workers} workers + {shards} "
            f"shards{' + a coordinator' if coordinators else ''} = {world}; start torchrun "
            "with that many processes in all"
        )
    if policy not in POLICIES:
        raise PlacementError(f"--placement {policy}: choose one of {', '.join(POLICIES)}")
    order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
    free = {h: [k for k, x in enumerate(hosts) if x == h] for h in order}
    roles: list[Role | None] = [None] * world

    def take(host: str, role: Role) -> None:
        roles[free[host].pop(0)] = role

    def worker(r: int, w: int) -> Role:
        return Role(WORKER, replica=r, worker=w)

    if policy == "ordered" or len(order) == 1:
        roles = [worker(*divmod(k, workers)) for k in range(replicas * workers)]
        roles += [Role(SHARD, shard=s) for s in range(shards)]
        roles += [Role(COORDINATOR)] * coordinators
    elif policy == "spread":
        for r in range(replicas):
            for w in range(workers):
                host = _with_room(order, free, start=w)
                take(host, worker(r, w))
        _place_shards(order, free, shards, take)
    else:
        for r in range(replicas):
            fits = [h for h in order if len(free[h]) >= workers]
            if fits:  # the tightest fit keeps big holes for later replicas
                host = min(fits, key=lambda h: len(free[h]))
                for w in range(workers):
                    take(host, worker(r, w))
                continue
            w = 0
            for host in sorted(order, key=lambda h: -len(free[h])):
                while free[host] and w < workers:
                    take(host, worker(r, w))
                    w += 1
        _place_shards(order, free, shards, take)
    if coordinators and policy != "ordered" and len(order) > 1:
        last = max(k for h in order for k in free[h])
        roles[last] = Role(COORDINATOR)
    return Placement(replicas, workers, shards, tuple(roles), tuple(hosts))  # type: ignore[arg-type]


def _with_room(order: list[str], free: dict[str, list[int]], start: int) -> str:
    for i in range(len(order)):
        host = order[(start + i) % len(order)]
        if free[host]:
            return host
    raise PlacementError("no free slot left")  # pragma: no cover - sizes were checked


def _place_shards(order, free, shards: int, take) -> None:
    i = 0
    for s in range(shards):
        host = _with_room(order, free, start=i)
        take(host, Role(SHARD, shard=s))
        i = order.index(host) + 1
