"""The parameter server's exchange as calibration measured it (`netpart.ps.timed_exchange`, run by
`netpart calibrate` on machines of their own): per training mode and number of clients of
one shard, the seconds of an exchange (a client's push of B bytes and its fetch of B bytes)
at each B, and the CPU seconds it took the client's machine to run one, divided by the
machine's share of a core (so: seconds of the machine kept busy, which a step's compute on
that machine cannot run beside).

And, where the calibration had the machines, one client whose bytes S shards hold in even
parts (`spread`, S >= 2, and its busy time, `spread_busy`): what a worker talking to several
shards takes, which the shards' side (one client of each) does not show: the client's own
work on its S messages.

And C >= 2 clients each of whose bytes S >= 2 shards hold (`mesh`, keyed "CxS", and the
client's busy time, `mesh_busy`): what a replica's worker takes where every shard also
serves the other replicas. Neither side alone shows it: several clients of several shards
take longer than either a client of several shards or several clients of one (a pause on any
machine holds up all of them). A layout
beyond the measured pairs is priced as the smallest measured one that covers it, or the
nearest.

Where the machines were held to a share of a core (`share`, a cpu quota; `quota_s`, the CPU
time the quota grants a period, which a shorter burst runs within at a whole core's speed),
`step_cpu_s` says what CPU a step timed alone took: what a worker's machine runs in a step
besides its exchange's, within the same quota (`netpart.planning.cluster`).

And the parameter server's alternative on the same machines (`allreduce`, per number of
machines M >= 2, and `allreduce_busy`): the seconds of a ring all-reduce of B bytes among M
machines, as DistributedDataParallel's replicas run one a step (in processes of their own:
`netpart.calibrate.ring`), read made non-decreasing by least squares (`read_pooled`: on
machines held to a share of a core the ring runs faster at 1 MB than at smaller sizes as a
rule, so the fastest larger size would misprice them). More machines than measured:
the most measured K's time for the bytes each of M's 2(M - 1) phases moves, times (M - 1) /
(K - 1) (`allreduce_s`).

And, where calibration timed it (`replica`), the step a DistributedDataParallel replica runs
without its ring, per model it calibrated: the model's reference module, forward, backward
and a whole model's update, on one of the machines (`netpart.calibrate.ddp_step`), at the
calibration's batch.

A shard with more clients than were measured serves their bytes as the most clients
measured would (the same bytes through the shard: `seconds_s` reads that table at k / K
times the bytes); a client of more shards than were measured, as the most shards measured.

And, where calibration timed them (`after`), the exchanges as training runs them: each
client runs a stand-in step (`netpart.ps.timed_exchange.stand_in`: `stand_in_s` CPU seconds of
compute, and its gradients written) before each request, C clients of S shards (both >= 1,
keyed "CxS"), their own sizes: a client's seconds from request to request, the step
included (sync: the step, then the exchange; Downpour: the step beside the exchange in
flight). Timed alone, an exchange misses what a step before it changes: a step before it
staggers the clients of a shard and changes what each client spends.
`netpart.planning.cluster` prices its stand-in with these tables'
layouts as it prices a model's, and carries what that price missed over to the model, where
the layout's own pair was measured.

JSON (in a profile's model, as `ps`; `spread`, `spread_busy`, `mesh`, `mesh_busy`,
`allreduce`, `allreduce_busy`, `replica`, `share` (default 1) and `quota_s` (default 0) may be
absent):
`{"sizes": [bytes, ...], "share": 0.3, "quota_s": 0.001,
  "seconds": {"sync"|"downpour": {"<clients>": [s, ...]}},
  "busy": {"sync"|"downpour": {"<clients>": [s, ...]}},
  "spread": {"sync"|"downpour": {"<shards>": [s, ...]}}, "spread_busy": {...},
  "mesh": {"sync"|"downpour": {"<clients>x<shards>": [s, ...]}}, "mesh_busy": {...},
  "allreduce": {"<machines>": [s, ...]}, "allreduce_busy": {...},
  "replica": {"batch": 32, "seconds": {"<model>": s}, "cpu_s": {"<model>": s}},
  "after": {"sizes": [bytes, ...], "stand_in_s": 0.1,
            "seconds": {"sync"|"downpour": {"<clients>x<shards>": [s, ...]}}}}`
(`after` may be absent; `replica.cpu_s` is for the reader, the planner does not read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netpart.cost.tables import read_pooled, read_table, table_points

__all__ = ["PS_MODES", "PsExchange"]

PS_MODES = ("sync", "downpour")
ALL = "all"  # the one "mode" of the all-reduce tables, as `_tables` reads them
Tables = dict[str, dict[int, tuple[tuple[float, float], ...]]]
Mesh = dict[str, dict[tuple[int, int], tuple[tuple[float, float], ...]]]


@dataclass(frozen=True)
class PsExchange:
    """Measured exchange tables: mode -> clients -> ((bytes, seconds), ...), sorted."""

    seconds: Tables
    busy: Tables
    spread: Tables = field(default_factory=dict)  # mode -> shards (>= 2) -> points
    spread_busy: Tables = field(default_factory=dict)
    mesh: Mesh = field(default_factory=dict)  # mode -> (clients, shards), both >= 2 -> points
    mesh_busy: Mesh = field(default_factory=dict)
    allreduce: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    allreduce_busy: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    share: float = 1.0  # of a core, each measured machine's
    quota_s: float = 0.0  # CPU seconds its quota grants a period (0: not known)
    after: Mesh = field(default_factory=dict)  # mode -> (clients, shards), both >= 1 -> points
    stand_in_s: float = 0.0  # CPU seconds of the step run before each of `after`'s requests
    replica: dict[str, float] = field(default_factory=dict)  # model -> a DDP replica's step
    replica_batch: int = 0  # the batch `replica` was timed at

    def seconds_s(self, mode: str, clients: int, nbytes: float) -> float:
        """An exchange of `nbytes` each way per client, `clients` at once through one shard."""
        table = self.seconds[mode]
        most = max(table)
        scale = clients / most if clients > most else 1.0
        return float(read_table(_nearest(table, clients), np.array(nbytes * scale)))

    def spread_s(self, mode: str, shards: int, nbytes: float) -> float:
        """One client's exchange of `nbytes` each way, held by `shards` shards in even parts
        (one shard: the one-client table; several, not measured: 0, the shards' side alone
        prices the exchange)."""
        table = self.spread.get(mode) or {}
        if shards < 2:
            return self.seconds_s(mode, 1, nbytes)
        if not table:
            return 0.0
        return float(read_table(_nearest(table, shards), np.array(nbytes)))

    def exchange_s(self, mode: str, clients: int, shards: int, nbytes: float) -> float:
        """One client's exchange of `nbytes` each way held by `shards` shards in even parts,
        each shard serving `clients` such clients (one client, one shard, or no pairs
        measured: `spread_s`, one client's alone; the shard's side is `seconds_s`)."""
        table = self.mesh.get(mode) or {}
        if clients < 2 or shards < 2 or not table:
            return self.spread_s(mode, shards, nbytes)
        return float(read_table(_nearest_pair(table, clients, shards), np.array(nbytes)))

    def after_s(self, mode: str, clients: int, shards: int, nbytes: float) -> float | None:
        """A client's seconds from request to request where it runs the stand-in step before
        each (module docstring): `shards` shards hold its `nbytes`, each serving `clients`
        such clients; None where that pair was not measured (another pair's stand-in would
        be priced off other clients than it ran with)."""
        points = (self.after.get(mode) or {}).get((clients, shards))
        return None if points is None else float(read_table(points, np.array(nbytes)))

    def busy_s(self, mode: str, nbytes: float, shards: int = 1, clients: int = 1) -> float:
        """Seconds one client's machine is kept busy by an exchange of `nbytes` each way with
        `shards` shards, each serving `clients` clients (more than measured: as the most
        measured)."""
        mesh = self.mesh_busy.get(mode) or {}
        if clients >= 2 and shards >= 2 and mesh:
            return float(read_table(_nearest_pair(mesh, clients, shards), np.array(nbytes)))
        table = self.spread_busy.get(mode) or {}
        if shards >= 2 and table:
            return float(read_table(_nearest(table, shards), np.array(nbytes)))
        return float(read_table(_nearest(self.busy[mode], 1), np.array(nbytes)))

    def allreduce_s(self, machines: int, nbytes: float, busy: bool = False) -> float:
        """A ring all-reduce of `nbytes` among `machines` (`busy`: the seconds it keeps each
        machine busy); 0 where none was measured (module docstring)."""
        table = self.allreduce_busy if busy else self.allreduce
        if machines < 2 or not table:
            return 0.0
        most = max(table)
        if machines <= most:
            return float(read_pooled(_nearest(table, machines), np.array(nbytes)))
        per_phase = nbytes * most / machines  # each phase's bytes, as `most` machines move them
        return float(read_pooled(table[most], np.array(per_phase))) * (machines - 1) / (most - 1)

    def replica_s(self, model: str) -> float | None:
        """A DistributedDataParallel replica's step of `model` without its ring, at
        `replica_batch`, where calibration timed it (module docstring); None where not."""
        return self.replica.get(model)

    @property
    def period_s(self) -> float:
        """The period of the measured machines' cpu quota: the CPU it grants a period over
        their share of a core (0: no quota)."""
        if self.share >= 1 or self.quota_s <= 0:
            return 0.0
        return self.quota_s / self.share

    def step_cpu_s(self, step_s: float) -> float:
        """The CPU a step that took `step_s` alone is charged on a measured machine's quota.
        Within the quota a step runs at a whole core's speed: its time. That over-counts its
        own CPU, and the excess stands for what a step and an exchange cost the machine
        together beyond the two apart: the total is what a step beside an exchange took on
        testbed machines, its split is not. A longer step was
        throttled as it went: its time x the share, at least the quota."""
        if self.share >= 1 or step_s <= self.quota_s:
            return step_s
        return max(self.quota_s, step_s * self.share)

    def to_dict(self) -> dict[str, Any]:
        def lists(tables: Tables | Mesh) -> dict:
            return {
                m: {_name(k): [t for _, t in p] for k, p in sorted(t.items())}
                for m, t in tables.items()
            }

        out = {
            "sizes": _sizes(self.seconds),
            "seconds": lists(self.seconds),
            "busy": lists(self.busy),
        }
        if self.share < 1:
            out.update(share=self.share, quota_s=self.quota_s)
        for what in ("spread", "spread_busy", "mesh", "mesh_busy"):
            if getattr(self, what):
                out[what] = lists(getattr(self, what))
        for what in ("allreduce", "allreduce_busy"):
            if getattr(self, what):
                out[what] = lists({ALL: getattr(self, what)})[ALL]
        if self.after:
            out["after"] = {
                "sizes": _sizes(self.after),
                "stand_in_s": self.stand_in_s,
                "seconds": lists(self.after),
            }
        if self.replica:
            out["replica"] = {"batch": self.replica_batch, "seconds": dict(self.replica)}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PsExchange:
        """ValueError if `data` is not the schema above."""
        if not isinstance(data, dict) or not isinstance(data.get("sizes"), list):
            raise ValueError("ps is {sizes: [...], seconds: {...}, busy: {...}}")
        sizes = [float(b) for b in data["sizes"]]
        seconds, busy = (
            _tables(data.get(what), sizes, what, "clients >= 1") for what in ("seconds", "busy")
        )
        pair = ("<clients>x<shards>, both >= 2", _pair)
        readers = {
            "spread": ("shards >= 1", _count),
            "spread_busy": ("shards >= 1", _count),
            "mesh": pair,
            "mesh_busy": pair,
        }
        optional = {
            what: {} if data.get(what) is None else _tables(data[what], sizes, what, count, key)
            for what, (count, key) in readers.items()
        }
        for what in ("allreduce", "allreduce_busy"):  # one table for every mode: ALL's
            if data.get(what) is not None:
                raw = {ALL: data[what]}
                optional[what] = _tables(raw, sizes, what, "machines >= 2", _machines, (ALL,))[ALL]
        if data.get("after") is not None:
            optional["after"], optional["stand_in_s"] = _after(data["after"])
        if data.get("replica") is not None:
            optional["replica"], optional["replica_batch"] = _replica(data["replica"])
        share, quota = data.get("share", 1.0), data.get("quota_s", 0.0)
        if not all(isinstance(v, int | float) for v in (share, quota)) or not (
            0 < share <= 1 and quota >= 0
        ):
            raise ValueError("ps.share is a fraction of a core (0 < share <= 1), quota_s >= 0")
        return cls(seconds=seconds, busy=busy, **optional, share=float(share), quota_s=float(quota))


def _sizes(tables: Tables | Mesh) -> list[float]:
    """The sizes a set of tables was measured at (every table of it has the same)."""
    return [b for b, _ in next(iter(next(iter(tables.values())).values()))]


def _nearest(table: dict[int, tuple], count: int) -> tuple:
    """The points of the fewest clients (or shards) measured at or above `count`; above
    them all, the most measured."""
    return table[min((c for c in table if c >= count), default=max(table))]


def _nearest_pair(table: dict[tuple[int, int], tuple], clients: int, shards: int) -> tuple:
    """The points of the smallest measured (clients, shards) covering both counts; none
    covering them, the nearest."""

    def far(pair: tuple[int, int]) -> tuple[bool, int]:
        return pair[0] < clients or pair[1] < shards, abs(pair[0] - clients) + abs(pair[1] - shards)

    return table[min(table, key=far)]


def _name(key: int | tuple[int, int]) -> str:
    """A table's key as JSON holds it: "<count>", or "<clients>x<shards>"."""
    return f"{key[0]}x{key[1]}" if isinstance(key, tuple) else str(key)


def _count(key: Any) -> int | None:
    return int(key) if str(key).isdigit() and int(key) >= 1 else None


def _pair(key: Any, least: int = 2) -> tuple[int, int] | None:
    """A "<clients>x<shards>" key, both >= `least` (None: not one)."""
    c, x, k = str(key).partition("x")
    ok = c.isdigit() and x and k.isdigit() and int(c) >= least and int(k) >= least
    return (int(c), int(k)) if ok else None


def _any_pair(key: Any) -> tuple[int, int] | None:
    return _pair(key, least=1)


def _after(raw: Any) -> tuple[Mesh, float]:
    """`ps.after` (module docstring): its tables and its stand-in's CPU seconds; ValueError
    if it is not that schema."""
    ok = isinstance(raw, dict) and isinstance(raw.get("sizes"), list) and raw["sizes"]
    stand_in = raw.get("stand_in_s") if ok else None
    if not ok or not isinstance(stand_in, int | float) or stand_in <= 0:
        raise ValueError("ps.after is {sizes: [bytes, ...], stand_in_s: > 0, seconds: {...}}")
    sizes = [float(b) for b in raw["sizes"]]
    pair = "<clients>x<shards>, both >= 1"
    return _tables(raw.get("seconds"), sizes, "after.seconds", pair, _any_pair), float(stand_in)


def _replica(raw: Any) -> tuple[dict[str, float], int]:
    """`ps.replica` (module docstring): each model's seconds and the batch; ValueError if it
    is not that schema."""
    ok = isinstance(raw, dict) and isinstance(raw.get("seconds"), dict)
    batch = raw.get("batch") if ok else None
    seconds = raw["seconds"] if ok else {}
    if (
        not ok
        or not isinstance(batch, int)
        or batch < 1
        or not all(isinstance(t, int | float) and t > 0 for t in seconds.values())
    ):
        raise ValueError('ps.replica is {"batch": >= 1, "seconds": {"<model>": > 0}}')
    return {str(m): float(t) for m, t in seconds.items()}, batch


def _machines(key: Any) -> int | None:
    """An all-reduce table's key: machines, at least 2 (None: not one)."""
    return int(key) if str(key).isdigit() and int(key) >= 2 else None


def _tables(
    raw: Any,
    sizes: list[float],
    what: str,
    count: str,
    key=_count,
    modes: tuple[str, ...] = PS_MODES,
) -> Any:
    """`ps.<what>`: mode (of `modes`) -> "<count>" -> a time per size, checked (ValueError);
    `key` reads a count (None: not one)."""
    if not isinstance(raw, dict) or set(raw) != set(modes):
        raise ValueError(f"ps.{what} needs a table per mode ({', '.join(modes)})")
    tables: dict = {}
    for mode, per in raw.items():
        if not isinstance(per, dict) or not per:
            raise ValueError(f"ps.{what}.{mode} is {{{count}: [seconds per size]}}")
        tables[mode] = {}
        for k, times in per.items():
            at = key(k)
            if at is None or not isinstance(times, list) or len(times) != len(sizes):
                raise ValueError(f"ps.{what}.{mode}: {count}, a time per size")
            tables[mode][at] = table_points(zip(sizes, times, strict=True), f"ps.{what}")
    return tables
