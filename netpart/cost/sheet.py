"""A machine on file, and the one reader of a prediction's machine (`load_machine`: --net,
--machine, --profile).

A machine description file (`--machine FILE`) states one model worker's machine and its link
in absolute figures, so that a prediction is for a machine a user names, not for this host
that hour; `MachineSheet` is its content, `to_machine` the `Machine` the planner predicts with.
It is a small TOML (or JSON) file, schema version 1 (docs/planning.md has the
schema), written by hand from a spec sheet or by `netpart calibrate` from its measurements:

    schema_version = 1
    name = "paper-2012"
    about = "what it stands for, and what was assumed"
    [compute]
    rate = "95 GFLOP/s"      # sustained per worker, forward + backward FLOPs
    overhead = "20 us"       # per layer slice per step (a call's fixed cost)
    per_value = "1 ns"       # per input value a slice reads (gather and scatter), x batch
    threads = 16             # cores a worker computes on (recorded, not modelled)
    [compute.kinds.dense]    # optional: a layer kind's own rate and overhead (conv-patches:
    rate = "120 GFLOP/s"     # conv outputs an irregular cut leaves to gathered patches)
    [network]
    bandwidth = "1 Gbit/s"   # per worker link, each way
    latency = "100 us"       # per exchange phase
    message = "50 us"        # per message: a phase with k peers pays k of them
    [step]
    overhead = "1 ms"        # per step beyond its layers (loss, bookkeeping)
    [memory]
    per_worker = "48 GiB"    # recorded; plans state it beside their estimate

Every figure takes a unit (`GFLOP/s`, `Gbit/s`, `us`, `GiB`, ...); a key that is not in the
schema, a figure without a unit or with the wrong kind of unit is refused in one line naming
the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from netpart.errors import PlanError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from netpart.cost.machine import PATCHES, Machine
from netpart.cost.tables import KindCost
from netpart.cost.units import EXAMPLES, quantity
from netpart.models.spec import LAYER_KINDS

__all__ = [
    "MACHINE_SCHEMA",
    "KindRate",
    "MachineSheet",
    "load_machine",
    "read_sheet",
    "sheet_toml",
]

MACHINE_SCHEMA = 1
_LARGEST = 1e18  # FLOPs: the far end of a rate's two-point table (read linearly in between)
_KEYS = {
    "": {"schema_version", "name", "about", "compute", "network", "step", "memory"},
    "compute": {"rate", "overhead", "per_value", "threads", "kinds"},
    "kind": {"rate", "overhead", "per_value"},
    "network": {"bandwidth", "latency", "message"},
    "step": {"overhead"},
    "memory": {"per_worker"},
}


@dataclass(frozen=True)
class KindRate:
    """A layer kind's compute: a slice of f FLOPs that reads v input values (both x batch)
    takes overhead_s + f / flops_per_s + v x per_value_s (gathering its inputs, scattering
    their gradients)."""

    flops_per_s: float
    overhead_s: float = 0.0
    per_value_s: float = 0.0

    def seconds(self, flops: np.ndarray) -> np.ndarray:
        return self.overhead_s + np.asarray(flops, dtype=np.float64) / self.flops_per_s


@dataclass(frozen=True)
class MachineSheet:
    """A machine description file's figures (module docstring), in SI units."""

    name: str
    flops_per_s: float
    overhead_s: float = 0.0
    per_value_s: float = 0.0
    kinds: dict[str, KindRate] = field(default_factory=dict)
    threads: int = 1
    bandwidth_bps: float = 1e9
    latency_s: float = 50e-6
    message_s: float = 0.0
    step_overhead_s: float = 0.0
    memory_bytes: float = 0.0  # 0: not stated
    about: str = ""

    def rate(self, kind: str) -> KindRate:
        """The compute of layers of `kind`: its own figures, else the machine's."""
        default = KindRate(self.flops_per_s, self.overhead_s, self.per_value_s)
        return self.kinds.get(kind, default)

    def faster(self, factor: float) -> MachineSheet:
        """The same machine with every compute rate `factor` times its own (the overheads
        and the link kept): the sensitivity of a fitted rate."""
        kinds = {k: replace(r, flops_per_s=r.flops_per_s * factor) for k, r in self.kinds.items()}
        return replace(self, flops_per_s=self.flops_per_s * factor, kinds=kinds)

    def to_machine(self, source: str = "") -> Machine:
        """The planner's model of this machine: per kind a two-point slice table that reads
        exactly overhead + FLOPs / rate, the link's latency, per-message cost and bandwidth,
        the step's overhead; halos overlap interior compute (machines of their own)."""
        kinds = {}
        for kind in (*LAYER_KINDS, PATCHES) if PATCHES in self.kinds else LAYER_KINDS:
            r = self.rate(kind)
            points = ((1.0, float(r.seconds(1.0))), (_LARGEST, float(r.seconds(_LARGEST))))
            kinds[kind] = KindCost(points, per_value=r.per_value_s)
        return Machine(
            bandwidth_bps=self.bandwidth_bps,
            latency_s=self.latency_s,
            message_s=self.message_s,
            flops_per_s=self.flops_per_s,
            kinds=kinds,
            step_fixed_s=self.step_overhead_s,
            overlap=True,
            machine=f"machine {self.name}" + (f" ({source})" if source else ""),
        )

    @classmethod
    def from_machine(
        cls, model: Machine, *, name: str, about: str = "", memory_bytes: float = 0.0
    ) -> MachineSheet:
        """The machine a calibrated model measured, in absolute figures: per layer kind the
        line seconds = overhead + FLOPs / rate through its slice table, fitted to relative
        errors (small slices count as much as large ones; at least 0 overhead), and its cost
        per input value; the machine's figures those of its dense slices (else the median
        kind's); the link's fitted latency and bandwidth; the step's fixed cost. A profile's
        per-layer tables and its corrections for processes sharing one host are not kept."""
        kinds = {}
        for kind, cost in model.kinds.items():
            f, t = np.array(sorted(cost.points), dtype=np.float64).T
            rate = float(np.median(f[-3:] / t[-3:]))  # the largest slices' rate
            overhead = max(0.0, float(np.median(t[:3] - f[:3] / rate)))  # the smallest's rest
            per_value = cost.per_value + model.fill_s_per_value
            kinds[kind] = KindRate(rate, overhead, per_value)
        base = kinds.get("dense") or (
            sorted(kinds.values(), key=lambda r: r.flops_per_s)[len(kinds) // 2]
            if kinds
            else KindRate(model.flops_per_s)
        )
        return cls(
            name=name,
            about=about,
            flops_per_s=base.flops_per_s,
            overhead_s=base.overhead_s,
            per_value_s=base.per_value_s,
            kinds=kinds,
            bandwidth_bps=model.bandwidth_bps,
            latency_s=model.latency_s,
            step_overhead_s=model.step_fixed_s,
            memory_bytes=memory_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        """The file's content in SI units (JSON; `sheet_toml` writes the TOML form)."""
        kinds = {
            k: {"rate": r.flops_per_s, "overhead": r.overhead_s, "per_value": r.per_value_s}
            for k, r in self.kinds.items()
        }
        return {
            "schema_version": MACHINE_SCHEMA,
            "name": self.name,
            "about": self.about,
            "compute": {
                "rate": self.flops_per_s,
                "overhead": self.overhead_s,
                "per_value": self.per_value_s,
                "threads": self.threads,
                "kinds": kinds,
            },
            "network": {
                "bandwidth": self.bandwidth_bps,
                "latency": self.latency_s,
                "message": self.message_s,
            },
            "step": {"overhead": self.step_overhead_s},
            "memory": {"per_worker": self.memory_bytes},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "machine", *, si: bool = True) -> MachineSheet:
        """A machine from a file's content; PlanError naming the key if it is not one.
        `si`: plain numbers are SI figures (JSON); a TOML file gives every figure a unit."""

        def fig(raw: Any, unit: str, key: str, *, positive: bool = False) -> float:
            return _figure(raw, unit, key, where, positive=positive, si=si)

        table = _table(data, "", where)
        if table.get("schema_version") != MACHINE_SCHEMA:
            raise PlanError(f"{where}: schema_version must be {MACHINE_SCHEMA}")
        name = table.get("name")
        if not isinstance(name, str) or not name:
            raise PlanError(f"{where}: 'name' must be a non-empty string")
        compute = _table(table.get("compute"), "compute", where)
        if "rate" not in compute:
            raise PlanError(f'{where}: compute.rate is required, e.g. rate = "95 GFLOP/s"')
        kinds = {}
        for kind, raw in _table(compute.get("kinds", {}), "compute.kinds", where).items():
            if kind not in (*LAYER_KINDS, PATCHES):
                raise PlanError(
                    f"{where}: compute.kinds.{kind}: unknown layer kind; use one "
                    f"of {', '.join(LAYER_KINDS)} or {PATCHES}"
                )
            k = _table(raw, "kind", where, f"compute.kinds.{kind}")
            kinds[kind] = KindRate(
                fig(k.get("rate"), "rate", f"compute.kinds.{kind}.rate", positive=True),
                fig(k.get("overhead", 0), "time", f"compute.kinds.{kind}.overhead"),
                fig(k.get("per_value", 0), "time", f"compute.kinds.{kind}.per_value"),
            )
        threads = compute.get("threads", 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise PlanError(f"{where}: compute.threads must be an integer >= 1")
        net = _table(table.get("network", {}), "network", where)
        step = _table(table.get("step", {}), "step", where)
        memory = _table(table.get("memory", {}), "memory", where)
        about = table.get("about", "")
        if not isinstance(about, str):
            raise PlanError(f"{where}: 'about' must be a string")
        return cls(
            name=name,
            about=about,
            threads=threads,
            kinds=kinds,
            flops_per_s=fig(compute["rate"], "rate", "compute.rate", positive=True),
            overhead_s=fig(compute.get("overhead", 0), "time", "compute.overhead"),
            per_value_s=fig(compute.get("per_value", 0), "time", "compute.per_value"),
            bandwidth_bps=fig(
                net.get("bandwidth", "1 Gbit/s"), "bits", "network.bandwidth", positive=True
            ),
            latency_s=fig(net.get("latency", "50 us"), "time", "network.latency"),
            message_s=fig(net.get("message", 0), "time", "network.message"),
            step_overhead_s=fig(step.get("overhead", 0), "time", "step.overhead"),
            memory_bytes=fig(memory.get("per_worker", 0), "bytes", "memory.per_worker"),
        )


def _table(raw: Any, kind: str, where: str, key: str | None = None) -> dict:
    """`raw` as a table whose keys are all in the schema's `kind`; PlanError otherwise."""
    key = kind if key is None else key
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: {key or 'the file'} must be a table")
    allowed = _KEYS.get(kind)
    if allowed is not None:
        for k in raw:
            if k not in allowed:
                dotted = f"{key}.{k}" if key else k
                raise PlanError(
                    f"{where}: unknown key {dotted!r}; allowed: {', '.join(sorted(allowed))}"
                )
    return raw


def _figure(
    raw: Any, unit: str, key: str, where: str, *, positive: bool = False, si: bool = True
) -> float:
    """A figure with its unit ('95 GFLOP/s', '50 us'), in SI units; a plain number is an SI
    figure only where `si` (JSON written by `to_dict`); 0 needs no unit."""
    example = EXAMPLES[unit]
    if isinstance(raw, bool) or raw is None:
        raise PlanError(f"{where}: {key} must be {example}")
    if isinstance(raw, int | float) and not si and raw != 0:
        raise PlanError(f"{where}: {key} = {raw!r}: give a unit, {example}")
    if isinstance(raw, int | float):
        value = float(raw)
    else:
        try:
            value = quantity(str(raw), unit)
        except ValueError:
            raise PlanError(f"{where}: {key} = {raw!r}: give {example}") from None
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise PlanError(f"{where}: {key} = {raw!r}: must be {'> 0' if positive else '>= 0'}")
    return value


def read_sheet(path: Path) -> MachineSheet:
    """The machine described by `path` (TOML, or JSON: a machine's `to_dict`, or a profile
    `netpart calibrate` wrote, whose "machine" section is read); one-line PlanError."""
    where = f"--machine {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlanError(f"{where}: not a text file; give a machine description (.toml)") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise PlanError(f"{where}: cannot parse it: {exc}") from None
    if isinstance(data, dict) and "machine" in data and "model" in data:  # a calibrate profile
        data = data["machine"]
    return MachineSheet.from_dict(data, where, si=path.suffix == ".json")


def sheet_toml(machine: MachineSheet) -> str:
    """The TOML form of `machine`, each figure with its unit."""
    lines = [
        f"schema_version = {MACHINE_SCHEMA}",
        f"name = {json.dumps(machine.name)}",
        f"about = {json.dumps(machine.about)}",
        "",
        "[compute]",
        f'rate = "{machine.flops_per_s / 1e9:.6g} GFLOP/s"',
        f'overhead = "{machine.overhead_s * 1e6:.6g} us"',
        f'per_value = "{machine.per_value_s * 1e9:.6g} ns"',
        f"threads = {machine.threads}",
    ]
    for kind, r in sorted(machine.kinds.items()):
        lines += [
            "",
            f"[compute.kinds.{kind}]",
            f'rate = "{r.flops_per_s / 1e9:.6g} GFLOP/s"',
            f'overhead = "{r.overhead_s * 1e6:.6g} us"',
            f'per_value = "{r.per_value_s * 1e9:.6g} ns"',
        ]
    lines += [
        "",
        "[network]",
        f'bandwidth = "{machine.bandwidth_bps / 1e9:.6g} Gbit/s"',
        f'latency = "{machine.latency_s * 1e6:.6g} us"',
        f'message = "{machine.message_s * 1e6:.6g} us"',
        "",
        "[step]",
        f'overhead = "{machine.step_overhead_s * 1e3:.6g} ms"',
        "",
        "[memory]",
        f'per_worker = "{machine.memory_bytes / 2**30:.6g} GiB"',
    ]
    return "\n".join(lines) + "\n"


def load_machine(profile: Path | None, net: str = "", machine: Path | None = None) -> Machine:
    """The one reader of a prediction's machine: the Machine of --profile FILE or
    --machine FILE (checked, one-line errors) with --net's figures over it (the cluster's
    links, this machine's compute), or of --net alone."""
    if machine is not None:
        if profile is not None:
            raise PlanError("give --profile or --machine, not both (a profile holds a machine)")
        model = read_sheet(machine).to_machine(str(machine))
        return Machine.parse(net, base=model) if net else model
    if profile is None:
        return Machine.parse(net) if net else Machine()
    try:
        text = profile.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"--profile {profile}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlanError(
            f"--profile {profile}: not a text file; give a profile `netpart calibrate` wrote"
        ) from None
    model = Machine.from_profile(text, str(profile))
    return Machine.parse(net, base=model) if net else model  # --net: the cluster's links
