"""Step 7 of the calibration (`netpart.calibrate.measure`): the parameter server's exchange,
measured with its own code (`netpart.ps.measure`) where the runner has machines of their own
(a `ps` method: the hosts of a torchrun job or a testbed). Per mode (sync, Downpour), 1 to
PS_CLIENTS clients of one shard, and one client whose values 2 to PS_SHARDS shards hold,
push and fetch each of PS_SIZES: seconds per exchange, and the CPU a client spends on one
over its machine's share of a core. The profile's `ps` (`netpart.partition.psx`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from netpart.partition.psx import PS_MODES, PsExchange

__all__ = ["PS_CLIENTS", "PS_SHARDS", "PS_SIZES", "per_size", "ps_tables"]

# bytes a client pushes and fetches, and timed exchanges of each: more of the short ones (on
# a fraction of a core, the periods a machine is throttled move the median of a few), fewer
# of 16 MB (seconds on a slow link); digits-mlp's replica holds 340 KB, bench-local's 40 MB
PS_SIZES = (16384, 65536, 262144, 1048576, 4194304, 16777216)
PS_REPEATS = (30, 30, 30, 20, 10, 3)
PS_CLIENTS = 4  # of one shard, at most
PS_SHARDS = 5  # one client's, at most (a 6-machine testbed: 2 to 5)


def ps_tables(runner: Any, say: Callable[[str], None]) -> tuple[PsExchange | None, dict | None]:
    """The tables and their raw JSON, or (None, None) where the runner cannot measure them."""
    if not hasattr(runner, "ps") or runner.machines < 2:
        return None, None
    tables = ("seconds", "busy", "spread", "spread_busy")
    raw: dict = {"sizes": list(PS_SIZES), **{t: {m: {} for m in PS_MODES} for t in tables}}
    most = runner.machines - 1  # machines left beside one shard, or beside one client
    configs = [(k, 1, "seconds", "busy", f"{k} client(s) of one shard")
               for k in range(1, min(most, PS_CLIENTS) + 1)]  # fmt: skip
    configs += [(1, s, "spread", "spread_busy", f"one client of {s} shards")
                for s in range(2, min(most, PS_SHARDS) + 1)]  # fmt: skip
    for mode in PS_MODES:
        for clients, shards, wall, busy, what in configs:
            seconds, cpu = _measure(runner, mode, clients, shards)
            key = str(max(clients, shards))
            raw[wall][mode][key] = [float(t) for t in seconds]
            raw[busy][mode][key] = [float(c) / runner.share for c in cpu]
            say(f"parameter server, {mode}, {what}, per exchange: {per_size(PS_SIZES, seconds)}")
    if not all(raw["spread"].values()):  # two machines: no client of two shards
        del raw["spread"], raw["spread_busy"]
    return PsExchange.from_dict(raw), raw


def _measure(runner: Any, mode: str, clients: int, shards: int) -> tuple[list, list]:
    """(seconds, CPU seconds) per exchange at each of PS_SIZES, a call per repeat count."""
    at: dict[int, tuple[float, float]] = {}
    for n in set(PS_REPEATS):
        sizes = tuple(b for b, r in zip(PS_SIZES, PS_REPEATS, strict=True) if r == n)
        t, c = runner.ps(mode, clients, sizes, n, shards=shards)
        at.update(zip(sizes, zip(t, c, strict=True), strict=True))
    return [at[b][0] for b in PS_SIZES], [at[b][1] for b in PS_SIZES]


def per_size(sizes, seconds) -> str:
    return ", ".join(f"{b >> 10} KB {t * 1e3:.2f} ms" for b, t in zip(sizes, seconds, strict=True))
