"""The parameter server's exchange as calibration measured it (`netpart.ps.measure`, run by
`netpart calibrate` on machines of their own): per training mode and number of clients of
one shard, the seconds of an exchange (a client's push of B bytes and its fetch of B bytes)
at each B, and the CPU seconds it took the client's machine to run one, divided by the
machine's share of a core (so: seconds of the machine kept busy, which a step's compute on
that machine cannot run beside).

And, where the calibration had the machines, one client whose bytes S shards hold in even
parts (`spread`, S >= 2, and its busy time, `spread_busy`): what a worker talking to several
shards takes, which the shards' side (one client of each) does not show: the client's own
work on its S messages.

A shard with more clients than were measured serves their bytes as the most clients
measured would (the same bytes through the shard: `seconds_s` reads that table at k / K
times the bytes); a client of more shards than were measured, as the most shards measured.

JSON (in a profile's model, as `ps`; `spread` and `spread_busy` may be absent):
`{"sizes": [bytes, ...], "seconds": {"sync"|"downpour": {"<clients>": [s, ...]}},
  "busy": {"sync"|"downpour": {"<clients>": [s, ...]}},
  "spread": {"sync"|"downpour": {"<shards>": [s, ...]}}, "spread_busy": {...}}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netpart.partition.tables import read_table, table_points

__all__ = ["PS_MODES", "PsExchange"]

PS_MODES = ("sync", "downpour")
Tables = dict[str, dict[int, tuple[tuple[float, float], ...]]]


@dataclass(frozen=True)
class PsExchange:
    """Measured exchange tables: mode -> clients -> ((bytes, seconds), ...), sorted."""

    seconds: Tables
    busy: Tables
    spread: Tables = field(default_factory=dict)  # mode -> shards (>= 2) -> points
    spread_busy: Tables = field(default_factory=dict)

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

    def busy_s(self, mode: str, nbytes: float, shards: int = 1) -> float:
        """Seconds one client's machine is kept busy by an exchange of `nbytes` each way with
        `shards` shards (more than measured: as the most measured)."""
        table = self.spread_busy.get(mode) or {}
        if shards >= 2 and table:
            return float(read_table(_nearest(table, shards), np.array(nbytes)))
        return float(read_table(_nearest(self.busy[mode], 1), np.array(nbytes)))

    def to_dict(self) -> dict[str, Any]:
        first = next(iter(next(iter(self.seconds.values())).values()))

        def lists(tables: Tables) -> dict:
            return {m: {str(k): [t for _, t in p] for k, p in sorted(t.items())}
                    for m, t in tables.items()}  # fmt: skip

        out = {"sizes": [b for b, _ in first], "seconds": lists(self.seconds),
               "busy": lists(self.busy)}  # fmt: skip
        for what in ("spread", "spread_busy"):
            if getattr(self, what):
                out[what] = lists(getattr(self, what))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PsExchange:
        """ValueError if `data` is not the schema above."""
        if not isinstance(data, dict) or not isinstance(data.get("sizes"), list):
            raise ValueError("ps is {sizes: [...], seconds: {...}, busy: {...}}")
        sizes = [float(b) for b in data["sizes"]]
        seconds, busy = (
            _tables(data.get(what), sizes, what, "clients") for what in ("seconds", "busy")
        )
        spread, spread_busy = (
            {} if data.get(what) is None else _tables(data[what], sizes, what, "shards")
            for what in ("spread", "spread_busy")
        )
        return cls(seconds=seconds, busy=busy, spread=spread, spread_busy=spread_busy)


def _nearest(table: dict[int, tuple], count: int) -> tuple:
    """The points of the fewest clients (or shards) measured at or above `count`; above
    them all, the most measured."""
    return table[min((c for c in table if c >= count), default=max(table))]


def _tables(raw: Any, sizes: list[float], what: str, count: str) -> Tables:
    """`ps.<what>`: mode -> "<count>" -> a time per size, checked (ValueError)."""
    if not isinstance(raw, dict) or set(raw) != set(PS_MODES):
        raise ValueError(f"ps.{what} needs a table per mode ({', '.join(PS_MODES)})")
    tables: Tables = {}
    for mode, per in raw.items():
        if not isinstance(per, dict) or not per:
            raise ValueError(f"ps.{what}.{mode} is {{{count}: [seconds per size]}}")
        tables[mode] = {}
        for k, times in per.items():
            if int(k) < 1 or len(times) != len(sizes):
                raise ValueError(f"ps.{what}.{mode}: {count} >= 1, a time per size")
            tables[mode][int(k)] = table_points(zip(sizes, times, strict=True), f"ps.{what}")
    return tables
