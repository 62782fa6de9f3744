"""A machine: what one model worker's machine and its link can do, the figures every
prediction reads. Defaults (1 Gbit/s, 50 us, 20 GFLOP/s) or `--net` figures; a machine
description file (`netpart.cost.sheet`: absolute rates, overheads and link figures, by hand
or from `netpart calibrate`) gives per-kind two-point slice tables; a calibrated profile
(`--profile FILE`) the slice tables, link tables and fixed costs this host measured.

A calibrated machine (`netpart calibrate` writes it; `--profile FILE` reads it) refines the terms
with what this machine measured: compute(l, w) = the time of a slice of that layer (its
`ModelSpec.layer_key`, where the calibration timed slices of it: `LayerCost`), else of that
kind, and FLOPs read off the measured slices (x (1 + parallel_slowdown) with more than one
worker: processes that share a machine's memory and cores) + fill_s_per_value x the input
values the slice reads (`partition.evaluate.input_values`: its gather, its gradient's
scatter); an exchange phase's time read off `link`, the runtime's exchange measured per size
and number of peers (latency + bytes / bandwidth where it has none); all x `slice_scale`
(slices in a step against slices timed alone), less `joined_saving_s` for a layer with no
halo (the runtime runs it in one autograd graph with the layer below); and `fixed` =
`step_fixed_s` (loss, interpreter) + with more than one worker, the loss's collective read
off `gather` (measured per number of workers: piecewise linear, the last segment's rate
beyond it) + `collective_s` (what else a step of more than one worker costs once). Where the
calibration stepped more than two workers, `crowd` adds what those steps held beyond that:
per number of workers a further compute slowdown and seconds per step (corrections: either
may be negative; machines that share a host slow down as more of them run at once), linear
in between, the largest count's beyond.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from netpart.cost.exchange import PsExchange
from netpart.cost.overlap import SPLIT_COST
from netpart.cost.tables import FORWARD_SHARE, KindCost, LayerCost, read_table, table_points
from netpart.cost.units import quantity
from netpart.errors import PlanError
from netpart.models.spec import BYTES_PER_VALUE

__all__ = ["PATCHES", "PROFILE_SCHEMA", "Machine"]

# The table of conv slices that multiply gathered patches (an irregular cut's positions); the
# "conv" table holds those torch's convolution computes (rectangles of the plane, whole layers).
PATCHES = "conv-patches"

# What a prediction from figures no machine measured says of itself: a calibrated profile
# predicted steps within 15% in most cases measured (docs/measurements.md), the defaults
# are a guess at a machine.
CALIBRATE_FOR = "calibrate (`netpart calibrate`) for figures within about 15%"
PROFILE_SCHEMA = 2  # 2: a kind's per_value counts the values a slice reads (1: its input buffer)


@dataclass(frozen=True)
class Machine:
    """Cluster figures the prediction uses. Defaults: 1 Gbit/s Ethernet, 50 µs, 20 GFLOP/s,
    no fixed costs; a calibrated profile adds per-kind compute and the runtime's fixed costs
    (module docstring), and names itself in `profile`."""

    bandwidth_bps: float = 1e9  # bits per second, per worker link
    latency_s: float = 50e-6  # per exchange phase
    message_s: float = 0.0  # per message: a phase with k peers pays k of them (no `link`)
    flops_per_s: float = 20e9  # sustained per worker (kinds not in `kinds`)
    kinds: dict[str, KindCost] = field(default_factory=dict)
    layers: dict[str, LayerCost] = field(default_factory=dict)  # by `ModelSpec.layer_key`
    fill_s_per_value: float = 0.0  # gathering a slice's input / scattering its gradient
    step_fixed_s: float = 0.0  # per step
    collective_s: float = 0.0  # per step with more than one worker, beyond `gather`
    parallel_slowdown: float = 0.0  # compute is (1 + this) x slower with more than one worker
    slice_scale: float = 1.0  # a slice in a step against the same slice timed alone
    joined_saving_s: float = 0.0  # per layer run in one autograd graph with the one below
    probe_s: float = 0.0  # median speed probe (CPU s) of the calibration runs (0: not measured)
    overlap: bool = True  # machines of their own: halo hidden behind interior compute
    split_cost: float = SPLIT_COST  # a split's extra work, of the work it hides behind
    # peers -> (bytes each way in all, seconds) of a phase with that many peers, sorted
    link: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # (workers, seconds) of the loss's collective among that many, sorted
    gather: tuple[tuple[float, float], ...] = ()
    # (workers >= 3, slowdown, seconds) of steps at that many workers beyond the 2-worker fit
    # (corrections: either may be negative)
    crowd: tuple[tuple[float, float, float], ...] = ()
    ps: PsExchange | None = None  # the parameter server's exchange, measured (`cost.exchange`)
    profile: str = ""  # the profile these figures came from ("": defaults or --net)
    machine: str = ""  # the machine description file they came from (`cost.sheet`)
    caveat: str = ""  # why the profile may not be trusted (`netpart calibrate --force`)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not (self.kinds or self.profile or self.machine):  # uncalibrated: three figures
            return {k: out[k] for k in ("bandwidth_bps", "latency_s", "flops_per_s")}
        kinds = {k: c.to_dict() for k, c in self.kinds.items()}
        layers = {k: c.to_dict() for k, c in self.layers.items()}
        link = {str(k): [list(p) for p in v] for k, v in self.link.items()}
        gather = [list(p) for p in self.gather]
        crowd = [list(p) for p in self.crowd]
        ps = self.ps.to_dict() if self.ps is not None else None
        return {
            **out,
            "kinds": kinds,
            "layers": layers,
            "link": link,
            "gather": gather,
            "crowd": crowd,
            "ps": ps,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Machine:
        data = dict(data)
        kinds = {k: KindCost.from_dict(v) for k, v in data.pop("kinds", {}).items()}
        layers = {str(k): LayerCost.from_dict(v) for k, v in data.pop("layers", {}).items()}
        profile = str(data.pop("profile", ""))
        machine = str(data.pop("machine", ""))
        caveat = str(data.pop("caveat", ""))
        raw = data.pop("link", {})
        if not isinstance(raw, dict):
            raise ValueError("link is {peers: [[bytes, seconds], ...]}")
        link = {int(k): table_points(v, "link") for k, v in raw.items()}
        if any(k < 1 or not v for k, v in link.items()):
            raise ValueError("link needs peers >= 1, each with (bytes, seconds) points")
        gather = table_points(data.pop("gather", ()), "gather")
        if any(n < 2 for n, _ in gather):
            raise ValueError("gather needs (workers >= 2, seconds) points")
        crowd = _crowd_points(data.pop("crowd", ()))
        ps = data.pop("ps", None)
        ps = PsExchange.from_dict(ps) if ps is not None else None
        overlap = data.pop("overlap", True)
        if not isinstance(overlap, bool):
            raise ValueError("overlap is true or false")
        floats = {k: float(v) for k, v in data.items()}
        return cls(
            **floats,
            kinds=kinds,
            layers=layers,
            overlap=overlap,
            link=link,
            gather=gather,
            crowd=crowd,
            ps=ps,
            profile=profile,
            machine=machine,
            caveat=caveat,
        )

    @classmethod
    def from_profile(cls, text: str, source: str) -> Machine:
        """The model of a `netpart calibrate` profile file; PlanError (one line) if it is not
        one."""
        try:
            data = json.loads(text)
            version = data.get("schema_version") if isinstance(data, dict) else None
            if version != PROFILE_SCHEMA:
                raise ValueError(
                    "schema_version 1 is an older calibration (other values per slice)"
                    if version == 1
                    else f"not a netpart calibrate profile (schema_version {PROFILE_SCHEMA})"
                )
            model = cls.from_dict({**data["model"], "profile": source})
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanError(
                f"--profile {source}: {exc}; write one with `netpart calibrate --out FILE`"
            ) from None
        fixed = (model.fill_s_per_value, model.step_fixed_s, model.collective_s)
        fixed += tuple(model.fixed_s(round(n)) for n, *_ in model.crowd)
        slow = (1 + model.parallel_slowdown + s for _, s, _ in model.crowd)
        if min(model.bandwidth_bps, model.flops_per_s, *slow) <= 0 or min(fixed) < 0:
            raise PlanError(
                f"--profile {source}: rates and compute slowdowns must be positive, fixed "
                "costs >= 0"
            )
        return model

    def faster(self, speed: float) -> Machine:
        """Machines `speed` times as fast as these: slices and FLOP rate scaled, the links and
        the fixed costs kept (`--net speed=8x`); the parameter server's measured exchange,
        which holds these machines' CPU, dropped (priced off the links instead)."""
        scale, flops = self.slice_scale / speed, self.flops_per_s * speed
        return replace(
            self, slice_scale=scale, flops_per_s=flops, ps=None if speed != 1 else self.ps
        )

    def describe(self) -> str:
        """Which figures a prediction used, in a few words."""
        wire = f"{self.bandwidth_bps / 1e9:.3g} Gbit/s, {_duration(self.latency_s)}"
        if self.machine:
            rate = f"{self.flops_per_s / 1e9:.4g} GFLOP/s per worker"
            return f"{self.machine}: {rate}, {wire} + {_duration(self.message_s)} per message"
        if self.profile:
            peers = "/".join(str(k) for k in sorted(self.link))
            link = f", link measured with {peers} peers" if self.link else ""
            if self.gather:
                link += f", collective with {'/'.join(f'{n:g}' for n, _ in self.gather)} workers"
            if self.crowd:
                link += f", steps at {'/'.join(f'{n:g}' for n, *_ in self.crowd)} workers"
            if self.layers:
                link += f", {len(self.layers)} layers' own slice tables"
            if self.ps is not None:
                ring = " and the all-reduce" if self.ps.allreduce else ""
                ddp = f", DDP's replica step of {', '.join(sorted(self.ps.replica))}"
                link += f", the parameter server's exchange{ring} measured"
                link += ddp if self.ps.replica else ""
            if self.slice_scale != 1.0:  # fitted, or --net speed=
                link += f", slice times x{self.slice_scale:.3g}"
            caveat = f"; WARNING: {self.caveat}" if self.caveat else ""
            return (
                f"calibrated profile {self.profile}: {self.bandwidth_bps / 1e9:.3g} Gbit/s, "
                f"{_duration(self.latency_s)}{link}{caveat}"
            )
        return (
            f"uncalibrated: {self.bandwidth_bps / 1e9:g} Gbit/s, {self.latency_s * 1e6:g} µs, "
            f"{self.flops_per_s / 1e9:g} GFLOP/s (defaults or --net); {CALIBRATE_FOR}"
        )

    def worker_compute_s(
        self,
        flops: np.ndarray,
        batch: int,
        kinds: list[str] | None = None,
        values: np.ndarray | None = None,
        keys: list[str] | None = None,
        *,
        convolved: np.ndarray | None = None,
    ) -> np.ndarray:
        """[L, P]: each worker's compute per layer, from FLOPs per example [L, P] (and,
        calibrated, the input values each worker's slice gathers per example [L, P]): read
        off the layer's own table where `layers` has its key (`ModelSpec.layer_key`), else
        off its kind's. `convolved` [L, P]: the share of each worker's conv outputs torch's
        convolution computes; where the machine has a `PATCHES` table the rest is read off
        it (each path's table at its own share of the work)."""
        out = flops * batch / self.flops_per_s
        if not self.kinds or kinds is None:
            return out
        gathered = np.zeros_like(out) if values is None else values * batch
        workers = flops.shape[1]
        crowd = self.crowd_terms(workers)[0]
        slow = self.slice_scale * (1.0 + (self.parallel_slowdown + crowd if workers > 1 else 0))
        for layer, kind in enumerate(kinds):
            own = self.layers.get(keys[layer]) if keys is not None else None
            cost = self.kinds.get(kind)
            if own is None and cost is None:
                continue
            work, reads = flops[layer] * batch, gathered[layer]
            patches = self.kinds.get(PATCHES) if kind == "conv" else None
            if patches is None or convolved is None:
                t = slow * _table_s(own, cost, work, reads)
            else:
                s = convolved[layer]
                by_conv = np.where(s > 0, _table_s(own, cost, work * s, reads * s), 0.0)
                rest = patches.seconds(work * (1 - s), reads * (1 - s))
                t = slow * (by_conv + np.where(s < 1, rest, 0.0))
            t = t + gathered[layer] * self.fill_s_per_value
            out[layer] = np.where(flops[layer] > 0, t, 0.0)
        return out

    def forward_shares(self, kinds: list[str] | None, layers: int) -> np.ndarray:
        """[L]: the share of each layer's slice time that is its forward pass."""
        if kinds is None:
            return np.full(layers, FORWARD_SHARE)
        return np.array([getattr(self.kinds.get(k), "forward_share", FORWARD_SHARE) for k in kinds])

    def allreduce_s(self, values: int, machines: int) -> float:
        """The one price of a ring all-reduce of `values` float32 among `machines`, DDP's
        collective: 2(M-1) phases, each moving 1/M of them to one peer, priced off the link
        (`phase_s`); where a profile measured the ring on its machines (`ps`), at least what
        it took there plus the time its CPU kept a machine busy (in a step the replica's
        compute takes the waits the ring's own work ran in alone), and on machines held to a
        share of a core, at least a quota period a phase."""
        if machines <= 1:
            return 0.0
        chunk = BYTES_PER_VALUE * values / machines
        ring = float(2 * (machines - 1) * self.phase_s(np.array([chunk]), 1)[0])
        if self.ps is None:
            return ring
        nbytes = BYTES_PER_VALUE * values
        timed = self.ps.allreduce_s(machines, nbytes) + self.ps.allreduce_s(
            machines, nbytes, busy=True
        )
        return max(ring, timed, 2 * (machines - 1) * self.ps.period_s)

    def phase_s(self, nbytes: np.ndarray, peers: np.ndarray | int = 1) -> np.ndarray:
        """Seconds of an exchange phase in which a worker moves `nbytes` (> 0) each way with
        `peers` others: read off the `link` table of the most peers measured up to `peers`
        (the fewest measured below them all), or latency + peers x message_s + bytes /
        bandwidth without one."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if not self.link:
            return (
                self.latency_s
                + self.message_s * np.asarray(peers)
                + nbytes * 8 / self.bandwidth_bps
            )
        counts = sorted(self.link)
        pick = np.clip(np.searchsorted(counts, peers, side="right") - 1, 0, None)
        out = np.zeros_like(nbytes)
        for i, k in enumerate(counts):
            out = np.where(pick == i, read_table(self.link[k], nbytes), out)
        return out

    def gather_s(self, workers: int) -> float:
        """The loss's collective among `workers` (> 1), read off `gather` (0 unmeasured)."""
        return float(read_table(self.gather, np.array(float(workers)))) if self.gather else 0.0

    def fixed_s(self, workers: int) -> float:
        """Per step, beyond layers: the runtime's own cost, and with N > 1 the loss's
        collective (`gather_s`) and `collective_s`."""
        if workers <= 1:
            return self.step_fixed_s
        crowd = self.crowd_terms(workers)[1]
        return self.step_fixed_s + self.gather_s(workers) + self.collective_s + crowd

    def crowd_terms(self, workers: int) -> tuple[float, float]:
        """(further compute slowdown, seconds per step) with `workers`, off `crowd`: none
        at 2 or fewer, linear between the measured counts, the largest count's beyond it."""
        if workers <= 2 or not self.crowd:
            return 0.0, 0.0
        n, slowdown, seconds = np.array(((2.0, 0.0, 0.0), *self.crowd)).T
        return float(np.interp(workers, n, slowdown)), float(np.interp(workers, n, seconds))

    @classmethod
    def parse(cls, text: str, base: Machine | None = None) -> Machine:
        """`bandwidth=10Gbit,latency=20us,flops=50G,speed=8x` (any subset) over the defaults,
        or over `base` (a calibrated profile: the cluster's network with this machine's
        compute, or `speed` times it: every slice that many times faster)."""
        values: dict[str, float] = {}
        speed = 1.0
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip().lower()
            try:
                if key == "bandwidth":
                    values["bandwidth_bps"] = quantity(raw, "bits", named=False)
                elif key == "latency":
                    values["latency_s"] = quantity(raw, "time", named=False)
                elif key == "flops":
                    values["flops_per_s"] = quantity(raw, "rate", named=False)
                elif key == "speed":  # machines this many times as fast as the profile's
                    speed = float(raw.removesuffix("x"))
                else:
                    raise PlanError(
                        f"--net: unknown key {key!r}; use bandwidth=1Gbit,latency=50us,flops=20G,"
                        "speed=8x"
                    )
            except ValueError:
                raise PlanError(
                    f"--net: cannot read {item!r}; e.g. bandwidth=10Gbit, latency=20us, flops=50G"
                ) from None
        if not speed > 0:
            raise PlanError("--net: speed must be positive, e.g. speed=8x")
        net = replace(base or cls(), **values, overlap=True)  # a cluster: machines of their own
        net = net.faster(speed)
        if {"bandwidth_bps", "latency_s"} & values.keys():
            # the cluster's network, not the measured one
            net = replace(net, link={}, gather=(), crowd=(), ps=None)
        if min(net.bandwidth_bps, net.flops_per_s) <= 0 or net.latency_s < 0:
            raise PlanError("--net: bandwidth and flops must be positive, latency >= 0")
        return net


def _table_s(
    own: LayerCost | None, cost: KindCost | None, work: np.ndarray, reads: np.ndarray
) -> np.ndarray:
    """Seconds of slices of `work` FLOPs reading `reads` values: off a layer's own table
    where it has one (FLOPs alone), else off its kind's."""
    return own.seconds(work) if own is not None else cost.seconds(work, reads)


def _duration(seconds: float) -> str:
    """A time in three figures: µs below a millisecond, ms above (a phase on a machine held to
    a share of a core can take milliseconds)."""
    if seconds < 0.9995e-3:  # 999.6 µs reads "1 ms", not "1e+03 µs"
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e3:.3g} ms"


def _crowd_points(raw: Any) -> tuple[tuple[float, float, float], ...]:
    """`crowd` from JSON: [[workers >= 3, slowdown, seconds], ...], sorted (corrections to
    the two-worker terms: either may be negative; `from_profile` checks what they leave)."""
    try:
        points = tuple(sorted((float(n), float(s), float(t)) for n, s, t in raw))
    except (TypeError, ValueError):
        raise ValueError("crowd is [[workers, slowdown, seconds], ...]") from None
    if any(n < 3 or not np.isfinite([s, t]).all() for n, s, t in points):
        raise ValueError("crowd needs workers >= 3 and finite slowdown and seconds")
    return points
