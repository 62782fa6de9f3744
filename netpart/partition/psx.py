"""The parameter server's exchange as calibration measured it (`netpart.ps.measure`, run by
`netpart calibrate` on machines of their own): per training mode and number of clients of
one shard, the seconds of an exchange (a client's push of B bytes and its fetch of B bytes)
at each B, and the CPU seconds it took the client's machine to run one, divided by the
machine's share of a core (so: seconds of the machine kept busy, which a step's compute on
that machine cannot run beside).

A shard with more clients than were measured serves their bytes as the most clients
measured would (the same bytes through the shard: `seconds_s` reads that table at k / K
times the bytes).

JSON (in a profile's model, as `ps`):
`{"sizes": [bytes, ...], "seconds": {"sync"|"downpour": {"<clients>": [s, ...]}},
  "busy": {"sync"|"downpour": {"<clients>": [s, ...]}}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def seconds_s(self, mode: str, clients: int, nbytes: float) -> float:
        """An exchange of `nbytes` each way per client, `clients` at once through one shard."""
        table = self.seconds[mode]
        most = max(table)
        k = min((c for c in table if c >= clients), default=most)
        scale = clients / most if clients > most else 1.0
        return float(read_table(table[k], np.array(nbytes * scale)))

    def busy_s(self, mode: str, nbytes: float) -> float:
        """Seconds one client's machine is kept busy by an exchange of `nbytes` each way."""
        return float(read_table(self.busy[mode][min(self.busy[mode])], np.array(nbytes)))

    def to_dict(self) -> dict[str, Any]:
        first = next(iter(next(iter(self.seconds.values())).values()))

        def lists(tables: Tables) -> dict:
            return {m: {str(k): [t for _, t in p] for k, p in sorted(t.items())}
                    for m, t in tables.items()}  # fmt: skip

        return {"sizes": [b for b, _ in first], "seconds": lists(self.seconds),
                "busy": lists(self.busy)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PsExchange:
        """ValueError if `data` is not the schema above."""
        if not isinstance(data, dict) or not isinstance(data.get("sizes"), list):
            raise ValueError("ps is {sizes: [...], seconds: {...}, busy: {...}}")
        sizes = [float(b) for b in data["sizes"]]
        out: list[Tables] = []
        for what in ("seconds", "busy"):
            raw = data.get(what)
            if not isinstance(raw, dict) or set(raw) != set(PS_MODES):
                raise ValueError(f"ps.{what} needs a table per mode ({', '.join(PS_MODES)})")
            tables: Tables = {}
            for mode, per in raw.items():
                if not isinstance(per, dict) or not per:
                    raise ValueError(f"ps.{what}.{mode} is {{clients: [seconds per size]}}")
                tables[mode] = {}
                for k, times in per.items():
                    if int(k) < 1 or len(times) != len(sizes):
                        raise ValueError(f"ps.{what}.{mode}: clients >= 1, a time per size")
                    pts = zip(sizes, times, strict=True)
                    tables[mode][int(k)] = table_points(pts, f"ps.{what}")
            out.append(tables)
        return cls(seconds=out[0], busy=out[1])
