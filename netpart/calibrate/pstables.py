"""Step 7 of the calibration (`netpart.calibrate.measure`): the parameter server's exchange,
measured with its own code (`netpart.ps.measure`) where the runner has machines of their own
(a `ps` method: the hosts of a torchrun job or a testbed). Per mode (sync, Downpour), C clients
whose values S shards hold in even parts, every pair with C <= PS_CLIENTS, S <= PS_SHARDS
and C + S at most the machines, push and fetch each of PS_SIZES: seconds per exchange, and
the CPU a client spends on one over its machine's share of a core. The profile's `ps`
(`netpart.partition.psx`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from netpart.partition.psx import PS_MODES, PsExchange

__all__ = ["PS_CLIENTS", "PS_SHARDS", "PS_SIZES", "per_size", "ps_tables"]

# bytes a client pushes and fetches, and timed exchanges of each: more of the short ones (on
# a fraction of a core, the periods a machine is throttled move the mean of a few), fewer
# of 16 MB (seconds on a slow link). Closer below 1 MB, where a message's cost steps as it
# outgrows a link's token bucket (80 KiB on a testbed): read between 256 KB (51 KB to each
# of 5 shards) and 1 MB, a 340 KB exchange (digits-mlp's replica; bench-local's holds 40 MB)
# with 5 shards priced sync 1x1+5 at 1.4-1.5x the samples/s it trained at (with these
# points, 1.3-1.4x: the rest is not the reading)
PS_SIZES = (16384, 65536, 131072, 262144, 393216, 524288, 1048576, 4194304, 16777216)
PS_REPEATS = (30, 30, 30, 30, 30, 30, 20, 10, 3)
PS_CLIENTS = 4  # of each shard, at most
PS_SHARDS = 5  # of each client, at most (a 6-machine testbed: 1 to 5)


def ps_tables(runner: Any, say: Callable[[str], None]) -> tuple[PsExchange | None, dict | None]:
    """The tables and their raw JSON, or (None, None) where the runner cannot measure them."""
    if not hasattr(runner, "ps") or runner.machines < 2:
        return None, None
    tables = ("seconds", "busy", "spread", "spread_busy", "mesh", "mesh_busy")
    raw: dict = {"sizes": list(PS_SIZES), **{t: {m: {} for m in PS_MODES} for t in tables}}
    pairs = [(c, s) for c in range(1, PS_CLIENTS + 1) for s in range(1, PS_SHARDS + 1)
             if c + s <= runner.machines]  # fmt: skip
    for mode in PS_MODES:
        for clients, shards in pairs:
            wall, busy, key = (("seconds", "busy", str(clients)) if shards == 1 else
                               ("spread", "spread_busy", str(shards)) if clients == 1 else
                               ("mesh", "mesh_busy", f"{clients}x{shards}"))  # fmt: skip
            seconds, cpu = _measure(runner, mode, clients, shards)
            raw[wall][mode][key] = [float(t) for t in seconds]
            raw[busy][mode][key] = [float(c) / runner.share for c in cpu]
            say(f"parameter server, {mode}, {clients} client(s) of {shards} shard(s), per "
                f"exchange: {per_size(PS_SIZES, seconds)}")  # fmt: skip
    for wall, busy in (("spread", "spread_busy"), ("mesh", "mesh_busy")):
        if not all(raw[wall].values()):  # too few machines for any such pair
            del raw[wall], raw[busy]
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
