"""Step 7 of the calibration (`netpart.calibrate.measure`): the parameter server's exchange,
measured with its own code (`netpart.ps.timed_exchange`) where the runner has machines of their own
(a `ps` method: the hosts of a torchrun job or a testbed). Per mode (sync, Downpour), C clients
whose values S shards hold in even parts, every pair with C <= PS_CLIENTS, S <= PS_SHARDS
and C + S at most the machines, push and fetch each of PS_SIZES that the link carries within
PS_WIRE_S: seconds per exchange, and the CPU a client spends on one over its machine's share
of a core. Every pair is timed in PS_PASSES passes spread over the calibration (`PsTables`:
the first before the step measurements, the others between and after their rounds), each
pass a share of PS_REPEATS (in proportion to the calibration's runs of a step measurement,
PS_RUNS by default), and the tables are each size's median over the passes: a slow spell of
the host then moves one pass of a table, not the table. And, timed last (`ring_plan`,
`with_rings`), per number of machines M from 2 to all of them, M ranks all-reducing each size
(the ring DistributedDataParallel's replicas run a step), its seconds and CPU likewise, in
processes of their own as DDP's (`netpart.calibrate.ring`). And every pair again, at a few
sizes, each client running a stand-in step before each request, as training runs its step
(`_after`). The profile's `ps` (`netpart.cost.exchange`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from netpart.cost.exchange import PS_MODES, PsExchange
from netpart.testbed.cgroups import MIN_QUOTA_US

__all__ = [
    "AFTER_SIZES",
    "PS_CLIENTS",
    "PS_PASSES",
    "PS_RUNS",
    "PS_SHARDS",
    "PS_SIZES",
    "STAND_IN_S",
    "PsTables",
    "pass_spread",
    "per_size",
    "ps_repeats",
    "ps_sizes",
    "ps_tables",
    "ring_plan",
    "with_rings",
]

# bytes a client pushes and fetches, and timed exchanges of each: more of the short ones (on a
# fraction of a core, the periods a machine is throttled move the mean of a few), fewer of the
# large ones (seconds on a slow link). Up to 40 MB, a replica's bytes for a model of 10M values:
# above the last size the table is read off its last segment, and a segment ending below 40 MB
# mispriced bench-local's 40 MB. Closer below 1 MB, where a message's cost steps as it outgrows a
# link's token bucket (80 KiB on a testbed). Round in decimal, not in powers of two: an exchange's
# time steps up where a shard's message reaches 64 KiB, and a point at exactly 64 KiB a message
# (128 KiB over 2 shards, 256 KiB over 4) read several times the next size up, pricing every size
# between off it.
PS_SIZES = (
    16_000,
    64_000,
    125_000,
    250_000,
    375_000,
    500_000,
    1_000_000,
    4_000_000,
    16_000_000,
    40_000_000,
)
PS_REPEATS = (30, 30, 30, 30, 30, 30, 20, 10, 5, 3)
PS_PASSES = 3  # passes over every pair and size (at most; at most one a run of a step measurement)
PS_RUNS = 5  # the calibration's runs of a step measurement (`--repeats`) PS_REPEATS are for
# A size whose bytes alone take longer than this on the measured link is not timed: there the
# exchange is the wire's, which the table's last segment carries on (repeats of such sizes
# for every pair of a 6-machine cluster on a slow link would take minutes).
# Sizes up to PS_ALWAYS are timed on any link.
PS_WIRE_S = 2.0
PS_ALWAYS = 4_000_000
# The exchanges timed after a stand-in step (`netpart.ps.timed_exchange.stand_in`, STAND_IN_S CPU
# seconds: of the order of an image model's one-worker step at batch 32 on one thread;
# bench-local's took 0.09-0.11), at a few sizes (each such exchange takes the step's time
# too), AFTER_REPEATS of each at PS_RUNS runs: the profile's `ps.after`.
STAND_IN_S = 0.1
AFTER_SIZES = (250_000, 4_000_000, 40_000_000)
AFTER_REPEATS = (6, 6, 4)
PS_CLIENTS = 4  # of each shard, at most
PS_SHARDS = 5  # of each client, at most (a 6-machine testbed: 1 to 5)


def ps_sizes(wire_bps: float, largest: float | None = None) -> tuple[int, ...]:
    """The PS_SIZES timed on a link of `wire_bps` (bits/s; 0: unknown, all of them), none
    above `largest` bytes where given (`netpart calibrate --ps-up-to`)."""
    sizes = tuple(b for b in PS_SIZES if largest is None or b <= largest)
    if not wire_bps > 0:
        return sizes
    return tuple(b for b in sizes if b <= PS_ALWAYS or 8 * b / wire_bps <= PS_WIRE_S)


def ps_repeats(size: int, runs: int = PS_RUNS) -> int:
    """Timed exchanges of `size` (one of PS_SIZES) where a step measurement has `runs` runs:
    PS_REPEATS in proportion, at least 2 (fewer runs: a quicker, noisier calibration)."""
    return _in_proportion(PS_REPEATS[PS_SIZES.index(size)], runs)


def _in_proportion(repeats: int, runs: int) -> int:
    """`repeats` (set for PS_RUNS runs) for `runs` runs, at least 2."""
    return max(2, round(repeats * runs / PS_RUNS))


def ps_tables(
    runner: Any,
    say: Callable[[str], None],
    *,
    wire_bps: float = 0.0,
    runs: int = PS_RUNS,
    passes: int | None = None,
    largest: float | None = None,
) -> tuple[PsExchange | None, dict | None]:
    """The tables and their raw JSON, or (None, None) where the runner cannot measure them;
    `wire_bps` and `largest`: which sizes (`ps_sizes`); `runs`: `ps_repeats`'; every pass
    back to back (`PsTables` spreads them over a calibration)."""
    tables = PsTables(runner, say, wire_bps=wire_bps, runs=runs, passes=passes, largest=largest)
    tables.time_after()
    return tables.result()


class PsTables:
    """The parameter server's tables of one calibration, timed in `passes` passes where the
    calibration puts them (`time_pass`, `between_rounds`), and the exchanges after a stand-in
    step (`time_after`); `result` times the passes still due and takes each size's median.
    `passes`: PS_PASSES, or as many as `runs` where fewer (a quicker, noisier calibration);
    `largest`: no size above it (`ps_sizes`). Inert where `runner` cannot measure them (no
    `ps`, or one machine)."""

    def __init__(
        self,
        runner: Any,
        say: Callable[[str], None],
        *,
        wire_bps: float = 0.0,
        runs: int = PS_RUNS,
        passes: int | None = None,
        largest: float | None = None,
    ) -> None:
        passes = min(PS_PASSES, runs) if passes is None else passes
        if passes < 1:
            raise ValueError(f"passes {passes}: 1 or more")
        self.able = hasattr(runner, "ps") and runner.machines >= 2
        self._runner, self._say, self._wire_bps, self._runs = runner, say, wire_bps, runs
        self.passes = passes
        self.sizes = ps_sizes(wire_bps, largest)
        self.pairs = [
            (c, s)
            for c in range(1, PS_CLIENTS + 1)
            for s in range(1, PS_SHARDS + 1)
            if c + s <= getattr(runner, "machines", 0)
        ]
        self._done: list[dict] = []  # each pass's raw tables
        self._after: dict | None = None

    def time_pass(self) -> None:
        """Time every mode and pair once more (a share of their repeats), if a pass is due."""
        if not self.able or len(self._done) >= self.passes:
            return
        k = len(self._done) + 1
        raw: dict = {t: {m: {} for m in PS_MODES} for t in _TABLES}
        for mode in PS_MODES:
            for clients, shards in self.pairs:
                seconds, cpu = _measure(
                    self._runner, mode, clients, shards, self.sizes, repeats=self.repeats
                )
                wall, busy, key = _keys(clients, shards)
                raw[wall][mode][key] = [float(t) for t in seconds]
                raw[busy][mode][key] = [float(c) / self._runner.share for c in cpu]
                self._say(
                    f"parameter server, pass {k} of {self.passes}, {mode}, {clients} "
                    f"client(s) of {shards} shard(s), per exchange: "
                    f"{per_size(self.sizes, seconds)}"
                )
        self._done.append(raw)

    @property
    def repeats(self) -> dict[int, int]:
        """Timed exchanges of each size in a pass: its share of `ps_repeats`, at least 2."""
        return {b: max(2, round(ps_repeats(b, self._runs) / self.passes)) for b in self.sizes}

    def between_rounds(self, rounds: int) -> Callable[[int], None]:
        """What to call after each of `rounds` rounds of step measurements (with the rounds
        done so far): the passes after the first, spread evenly over the rounds, the last
        after the last round."""
        due = {round(k * rounds / max(1, self.passes - 1)) for k in range(1, self.passes)}

        def after_round(done: int) -> None:
            if done in due:
                self.time_pass()

        return after_round

    def time_after(self) -> None:
        """Time every pair after a stand-in step (`ps.after`), once."""
        if self.able and self._after is None:
            self._after = _after(
                self._runner, self._say, self.pairs, timed=self.sizes, runs=self._runs
            )

    def result(self) -> tuple[PsExchange | None, dict | None]:
        """The tables (each size's median over the passes) and their raw JSON, every pass's
        wall-clock tables in its `passes`; (None, None) where the runner cannot measure."""
        if not self.able:
            return None, None
        while len(self._done) < self.passes:
            self.time_pass()
        # a table of no pair (a client of several shards on 2 machines) is left out
        tables = {t: v for t, v in _medians(self._done).items() if all(v.values())}
        raw: dict = {"sizes": list(self.sizes), **tables}
        if self._runner.share < 1:  # a testbed's quota (`netpart.testbed.cgroups`): 1 ms a period
            raw.update(share=self._runner.share, quota_s=MIN_QUOTA_US / 1e6)
        if self._after is not None:
            raw["after"] = self._after
        if self.passes > 1:
            walls = [t for t in tables if not t.endswith("busy")]
            raw["passes"] = [{t: p[t] for t in walls} for p in self._done]
            self._say(pass_spread(raw))
        return PsExchange.from_dict(raw), raw


_TABLES = ("seconds", "busy", "spread", "spread_busy", "mesh", "mesh_busy")


def _keys(clients: int, shards: int) -> tuple[str, str, str]:
    """(wall-clock table, busy table, key) of a pair in the profile's `ps`."""
    if shards == 1:
        return "seconds", "busy", str(clients)
    if clients == 1:
        return "spread", "spread_busy", str(shards)
    return "mesh", "mesh_busy", f"{clients}x{shards}"


def _medians(passes: list[dict]) -> dict:
    """Each table's median over `passes` (raw tables of the same pairs and sizes), per size."""
    first = passes[0]
    return {
        t: {
            m: {
                key: [float(x) for x in np.median([p[t][m][key] for p in passes], axis=0)]
                for key in first[t][m]
            }
            for m in first[t]
        }
        for t in first
    }


def pass_spread(raw: dict) -> str:
    """One line: how far a single pass's wall-clock tables of `raw` (with `passes`) read
    from their median, over every mode, pair and size (10th-90th percentile and the extremes)."""
    ratios = [
        t / m
        for p in raw["passes"]
        for wall, by_mode in p.items()
        for mode, by_key in by_mode.items()
        for key, ts in by_key.items()
        for t, m in zip(ts, raw[wall][mode][key], strict=True)
        if m > 0
    ]
    lo, p10, p90, hi = np.percentile(ratios, [0, 10, 90, 100])
    return (
        f"parameter server: each size's median of {len(raw['passes'])} passes; a pass read "
        f"{p10:.2f}-{p90:.2f}x it (10th-90th percentile; {lo:.2f}-{hi:.2f}x at the extremes)"
    )


def ring_plan(raw: dict | None, runs: int = PS_RUNS) -> dict | None:
    """The all-reduce to time once the tables `raw` are measured (None: none were): their
    sizes, each `ps_repeats` times (`netpart.calibrate.hosts.HostsRunner.close`)."""
    if not raw:
        return None
    sizes = [int(b) for b in raw["sizes"]]
    return {"sizes": sizes, "repeats": [ps_repeats(b, runs) for b in sizes]}


def with_rings(
    raw: dict, rings: dict[int, tuple[list, list]], say: Callable[[str], None]
) -> tuple[PsExchange, dict]:
    """The tables `raw` with the all-reduce among each number of machines timed (`rings`:
    seconds and CPU seconds per size, `netpart.calibrate.ring.rings`), its busy time the CPU
    over the machines' share."""
    share = raw.get("share", 1.0)
    raw = {**raw, "allreduce": {}, "allreduce_busy": {}}
    for machines, (seconds, cpu) in sorted(rings.items()):
        raw["allreduce"][str(machines)] = [float(t) for t in seconds]
        raw["allreduce_busy"][str(machines)] = [float(c) / share for c in cpu]
        say(f"all-reduce among {machines} machines: {per_size(raw['sizes'], seconds)}")
    return PsExchange.from_dict(raw), raw


def _after(
    runner: Any,
    say: Callable[[str], None],
    pairs: list[tuple[int, int]],
    *,
    timed: tuple[int, ...],
    runs: int,
) -> dict:
    """`ps.after` (`netpart.cost.exchange`): each mode and pair's exchanges, each client
    running the stand-in step before each request, at the AFTER_SIZES of the sizes `timed`;
    a call per size and pair."""
    sizes = [b for b in AFTER_SIZES if b in timed]
    after: dict = {"sizes": sizes, "stand_in_s": STAND_IN_S, "seconds": {}}
    for mode in PS_MODES:
        after["seconds"][mode] = {}
        for clients, shards in pairs:
            seconds = []
            for b in sizes:
                n = _in_proportion(AFTER_REPEATS[AFTER_SIZES.index(b)], runs)
                t, _ = runner.ps(mode, clients, (b,), n, shards=shards, stand_in=STAND_IN_S)
                seconds.append(float(t[0]))
            after["seconds"][mode][f"{clients}x{shards}"] = seconds
            say(
                f"parameter server, {mode}, {clients} client(s) of {shards} shard(s), after a "
                f"{STAND_IN_S * 1e3:.0f} ms CPU step, per step: {per_size(sizes, seconds)}"
            )
    return after


def _measure(
    runner: Any, mode: str, clients: int, shards: int, sizes, *, repeats: dict[int, int]
) -> tuple[list, list]:
    """(seconds, CPU seconds) per exchange at each of `sizes` (`repeats` of each), a call
    per repeat count."""
    at: dict[int, tuple[float, float]] = {}
    for n in sorted(set(repeats.values()), reverse=True):  # the short ones first
        some = tuple(b for b in sizes if repeats[b] == n)
        t, c = runner.ps(mode, clients, some, n, shards=shards)
        at.update(zip(some, zip(t, c, strict=True), strict=True))
    return [at[b][0] for b in sizes], [at[b][1] for b in sizes]


def per_size(sizes, seconds) -> str:
    """Each size and its time: decimal kB or MB, or KiB for a power of two ("64 KiB 1.32 ms",
    "16 MB 250.00 ms")."""

    def size(b: int) -> str:
        if b >= 1024 and b & (b - 1) == 0:
            return f"{b >> 10} KiB"
        return f"{b / 1e6:g} MB" if b >= 1_000_000 else f"{b / 1e3:g} kB"

    return ", ".join(f"{size(b)} {t * 1e3:.2f} ms" for b, t in zip(sizes, seconds, strict=True))
