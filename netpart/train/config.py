"""TrainConfig: everything a training job needs besides the spec and the plan, validated once:
a tree of five frozen sections, each a group of `netpart train`'s flags.

Schema (`train.json` in the run directory, next to `spec.json`, `plan.json`, `node_map.npy`):
  schema_version  2 (1: `config` flat, its fields as the command line names them; still read)
  model, fingerprint   the spec's name and fingerprint (a resume must match)
  layout          hash of the node map, granularity, workers and shards (a resume must match)
  workers         model workers per replica
  config          the sections below, each an object of its fields:
    model       init
    data        source, layout, examples, batch
    optimiser   name, lr, n_fetch, n_push, push_norm, dc_lambda, local_update, warm_start,
                units, history, line_search
    cluster     replicas, shards, mode, placement, threads, restarts, timeout
    run         steps, seed, dtype, checkpoint_every, snapshot_every, eval_every, log
The command line names every field flat (`FLAT`: `--data` is data.source, `--optimizer`
optimiser.name, `--ps-shards` cluster.shards); `TrainConfig.of` builds the tree from those
names. Ranks of a job: on one machine, worker w of replica r is rank r * workers + w and shard
s is rank R * workers + s; across machines `placement` decides (netpart.train.placement).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from netpart.errors import TrainError
from netpart.models.spec import DTYPE_NAMES
from netpart.partition.plans import PartitionPlan
from netpart.ps.optimizer import OPTIMIZERS, Optimizer
from netpart.train.placement import POLICIES

MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: a longer wait is no longer a timeout
MIN_TIMEOUT = 0.1  # s: shorter, a healthy peer's message is late
START_MIN_S = 10.0  # s the start-up deadline is at least (--timeout above it: that)
MAX_SEED = 2**63 - 1  # seeds key Philox streams as unsigned 64-bit integers

__all__ = [
    "DEFAULT_LR",
    "FLAT",
    "MAX_SEED",
    "MAX_TIMEOUT",
    "MIN_TIMEOUT",
    "MODES",
    "SCHEMA_VERSION",
    "ClusterConfig",
    "DataConfig",
    "ModelConfig",
    "OptimiserConfig",
    "RunConfig",
    "TrainConfig",
    "TrainError",
    "layout_key",
]

SCHEMA_VERSION = 2
MODES = ("downpour", "sync", "sandblaster")
LOCAL_UPDATE = ("auto", "on", "off")
INITS = ("seed", "module")  # netpart's seeded initial weights, or the user's module's
# Adagrad's is torch.optim.Adagrad's: Adagrad's first steps move every weight by about lr
# at once, and larger rates made image models' losses spike by orders of magnitude before
# they recovered (docs/training.md). L-BFGS's is torch.optim.LBFGS's.
DEFAULT_LR = {"adagrad": 0.01, "sgd": 0.05, "lbfgs": 1.0}


@dataclass(frozen=True)
class ModelConfig:
    init: str = "seed"  # seed | module: the initial weights (module: the user's, initial.pt)


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic, shapes, digits, a .npz or a folder of images
    layout: str = "nchw"  # an image model's .npz arrays: nchw, or nhwc (transposed)
    examples: int = 60000  # synthetic dataset size
    batch: int = 32  # examples per step and replica


@dataclass(frozen=True)
class OptimiserConfig:
    name: str = "adagrad"  # sgd | adagrad | lbfgs
    lr: float | None = None  # None: DEFAULT_LR of the optimiser
    n_fetch: int = 1  # downpour: fetch every K steps
    n_push: int = 1  # downpour: push every K steps
    push_norm: float = 0.0  # downpour: also push once the gradient's L2 norm reaches this
    dc_lambda: float = 0.0  # downpour: DC-ASGD delay compensation strength (0: off)
    local_update: str = "auto"  # downpour: each step also applied by the replica
    warm_start: int = 0  # steps replica 0 trains alone (downpour)
    units: int = 16  # sandblaster: work units per batch (steps = L-BFGS iterations)
    history: int = 10  # sandblaster: L-BFGS curvature pairs kept in the shards
    line_search: str = "armijo"  # sandblaster: armijo | none (torch.optim.LBFGS's fixed step)

    def __post_init__(self) -> None:
        if self.lr is None and self.name in DEFAULT_LR:
            object.__setattr__(self, "lr", DEFAULT_LR[self.name])


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    shards: int = 1
    mode: str = "downpour"  # downpour | sync | sandblaster
    placement: str = "pack"  # pack | spread | ordered (see netpart.train.placement)
    threads: int = 1  # torch threads per process
    restarts: int = 3  # times a shard that dies is restarted from its last checkpoint
    timeout: float = 60.0  # seconds a process waits for a peer


@dataclass(frozen=True)
class RunConfig:
    steps: int = 100
    seed: int = 0  # weights, data and partitioner
    dtype: str = "float32"
    checkpoint_every: int = 50  # shard updates between checkpoints
    snapshot_every: int = 0  # shard updates between kept snapshots (0: none), for curves
    eval_every: int = 0  # replica 0 evaluates on held-out data every K steps (0: at the end only)
    log: str = ""  # comma-separated loggers besides the run's JSON lines: csv, tensorboard


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optimiser": OptimiserConfig,
    "cluster": ClusterConfig,
    "run": RunConfig,
}
# The command line's name of every field, where it is not the field's own: data.source is
# --data, data.layout --layout (data_layout), optimiser.name --optimizer.
FLAT_NAMES = {("data", "source"): "data", ("data", "layout"): "data_layout"}
FLAT_NAMES[("optimiser", "name")] = "optimizer"
# Every field by its command-line name: (section, field).
FLAT = {
    FLAT_NAMES.get((section, f.name), f.name): (section, f.name)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}


@dataclass(frozen=True)
class TrainConfig:
    """The job's configuration, by section; `TrainConfig.of(**flat)` from the command line's
    names. Validated across sections when made (the modes' options, the loggers, ...)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimiser: OptimiserConfig = field(default_factory=OptimiserConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def of(cls, **flat: Any) -> TrainConfig:
        """The config whose fields the command line's names give (`FLAT`), the rest defaults."""
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TrainError(f"unknown config fields {unknown}")
        parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in flat.items():
            section, key = FLAT[name]
            parts[section][key] = value
        return cls(**{section: SECTIONS[section](**kw) for section, kw in parts.items()})

    def get(self, name: str) -> Any:
        """A field by its command-line name (`FLAT`)."""
        section, key = FLAT[name]
        return getattr(getattr(self, section), key)

    def flat(self) -> dict[str, Any]:
        """Every field by its command-line name."""
        return {name: self.get(name) for name in FLAT}

    def with_flat(self, **flat: Any) -> TrainConfig:
        """This config with the fields named (command-line names) replaced, validated again."""
        return TrainConfig.of(**{**self.flat(), **flat})

    def __post_init__(self) -> None:
        for name in ("replicas", "shards", "n_fetch", "n_push", "batch", "checkpoint_every"):
            _at_least(name, self.get(name), 1)
        for name in ("units", "history", "threads"):
            _at_least(name, self.get(name), 1)
        for name in ("steps", "warm_start", "snapshot_every", "restarts", "eval_every"):
            _at_least(name, self.get(name), 0)
        if self.cluster.mode not in MODES:
            raise TrainError(f"--mode {self.cluster.mode}: choose one of {', '.join(MODES)}")
        if (name := self.optimiser.name) not in OPTIMIZERS:
            raise TrainError(f"--optimizer {name}: choose one of {', '.join(OPTIMIZERS)}")
        for name in ("lr", "dc_lambda", "push_norm", "timeout"):
            if not math.isfinite(self.get(name)):
                flag = "--" + name.replace("_", "-")
                raise TrainError(f"{flag} {self.get(name)}: must be a finite number")
        if not self.optimiser.lr > 0:
            raise TrainError(f"--lr {self.optimiser.lr}: the learning rate must be > 0")
        if self.run.dtype not in DTYPE_NAMES:
            raise TrainError(f"dtype {self.run.dtype}: choose one of {', '.join(DTYPE_NAMES)}")
        if (policy := self.cluster.placement) not in POLICIES:
            raise TrainError(f"--placement {policy}: choose one of {', '.join(POLICIES)}")
        for name in ("dc_lambda", "push_norm"):
            if not self.get(name) >= 0:
                flag = "--" + name.replace("_", "-")
                raise TrainError(f"{flag} {self.get(name)}: must be >= 0")
        self._check_modes()
        self._check_surroundings()

    def _check_modes(self) -> None:
        """The checks of options that only some modes take."""
        mode, opt = self.cluster.mode, self.optimiser
        if mode == "sync" and (opt.dc_lambda or opt.push_norm):
            raise TrainError(
                "--dc-lambda and --push-norm apply to --mode downpour (sync pushes every step, "
                "and its gradients are never stale)"
            )
        if opt.local_update not in LOCAL_UPDATE:
            raise TrainError(f"--local-update {opt.local_update}: choose auto, on or off")
        if opt.local_update == "on" and not self._local_defined:
            raise TrainError(
                "--local-update on needs --mode downpour and --optimizer sgd without --dc-lambda "
                "(the replica applies p -= lr * g itself, as the shards' SGD does)"
            )
        if (mode == "sandblaster") != (opt.name == "lbfgs"):
            raise TrainError(
                "--mode sandblaster goes with --optimizer lbfgs, and lbfgs only with sandblaster"
            )
        if opt.line_search not in ("armijo", "none"):
            raise TrainError(f"--line-search {opt.line_search}: choose armijo or none")
        if mode == "sandblaster" and self.run.eval_every:
            raise TrainError(
                "--eval-every applies to downpour and sync (sandblaster.jsonl "
                "has every L-BFGS evaluation's loss)"
            )
        if mode == "sandblaster" and opt.units > self.data.batch:
            raise TrainError(f"--units {opt.units}: at most --batch {self.data.batch} units")

    def _check_surroundings(self) -> None:
        """The checks of the job's surroundings: initial weights, loggers, data layout,
        timeout, seed."""
        if self.model.init not in INITS:
            raise TrainError(f"--init {self.model.init}: choose seed or module")
        for name in self.loggers:
            if name not in ("csv", "tensorboard"):
                raise TrainError(f"--log {name}: choose from csv, tensorboard (comma-separated)")
        if self.data.layout not in ("nchw", "nhwc"):
            raise TrainError(f"--layout {self.data.layout}: choose nchw or nhwc")
        if not MIN_TIMEOUT <= (timeout := self.cluster.timeout) <= MAX_TIMEOUT:
            raise TrainError(
                f"--timeout {timeout}: give {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} seconds"
            )
        seed = self.run.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed <= MAX_SEED):
            raise TrainError(f"--seed {seed}: give an integer from 0 to {MAX_SEED}")

    @property
    def start_timeout(self) -> float:
        """Seconds every process of a job has to start (join the group and learn its role;
        healthy ones take about one): --timeout, at least START_MIN_S."""
        return max(START_MIN_S, self.cluster.timeout)

    @property
    def _local_defined(self) -> bool:
        opt = self.optimiser
        return self.cluster.mode == "downpour" and opt.name == "sgd" and opt.dc_lambda == 0

    @property
    def local_steps(self) -> bool:
        """Whether a Downpour replica applies each step to its own parameters (the paper's
        client: p -= lr * g) and brings fetched values up to date with its pushes they do not
        reflect yet: with --local-update auto (the default) wherever the shards' rule is SGD
        and no delay compensation reads the versions served."""
        return self.optimiser.local_update != "off" and self._local_defined

    @property
    def loggers(self) -> tuple[str, ...]:
        """The loggers `run.log` names (`netpart.train.loggers`)."""
        return tuple(x.strip() for x in self.run.log.split(",") if x.strip())

    @property
    def optim(self) -> Optimizer:
        return Optimizer(self.optimiser.name, self.optimiser.lr)

    @property
    def coordinators(self) -> int:
        """Sandblaster has one coordinator process (the last rank on one machine)."""
        return 1 if self.cluster.mode == "sandblaster" else 0

    def world(self, workers: int) -> int:
        return self.cluster.replicas * workers + self.cluster.shards + self.coordinators

    def dataset(self, spec: Any, source: str | None = None) -> Any:
        """The job's data for `spec` (`netpart.data.load_data`: DataError in one line), from
        its data section and seed; `source` instead of the section's (`netpart eval --data`)."""
        from netpart.data import load_data

        data = self.data
        return load_data(source or data.source, spec, self.run.seed, data.examples, data.layout)

    def memory_job(self, workers: int) -> dict[str, Any]:
        """This job on `workers` workers as `netpart.planning.memory.estimate` reads it."""
        return {
            "batch": self.data.batch,
            "replicas": self.cluster.replicas,
            "processes": self.world(workers),
            "dtype": self.run.dtype,
            "optimizer": self.optimiser.name,
            "history": self.optimiser.history,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, source: str = "train.json") -> TrainConfig:
        """The config `data` holds: its sections (schema 2), or its fields flat by their
        command-line names (schema 1, or the command line's)."""
        if not isinstance(data, dict):
            raise TrainError(f"{source}: config must be an object")
        if not any(isinstance(v, dict) for v in data.values()):  # flat (no section)
            unknown = sorted(set(data) - set(FLAT))
            if unknown:
                raise TrainError(f"{source}: unknown config fields {unknown}")
            return cls.of(**data)
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise TrainError(f"{source}: unknown config sections {unknown}")
        parts = {}
        for section, kw in data.items():
            names = {f.name for f in dataclasses.fields(SECTIONS[section])}
            if not isinstance(kw, dict):
                raise TrainError(f"{source}: config section {section} must be an object")
            if wrong := sorted(set(kw) - names):
                raise TrainError(f"{source}: config section {section}: unknown fields {wrong}")
            parts[section] = SECTIONS[section](**kw)
        return cls(**parts)

    @classmethod
    def from_json(cls, text: str, source: str = "train.json") -> TrainConfig:
        try:
            return cls.from_dict(json.loads(text), source)
        except json.JSONDecodeError as exc:
            raise TrainError(f"{source}: not valid JSON ({exc})") from None


def _at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--ps-shards" if name == "shards" else "--" + name.replace("_", "-")
        raise TrainError(f"{flag} {value!r}: must be an integer >= {minimum}")


def layout_key(plan: PartitionPlan, shards: int) -> str:
    """Identifies where every parameter lives: same key, same shard ranges."""
    h = hashlib.sha256()
    h.update(plan.node_map.astype("int64").tobytes())
    h.update(json.dumps([plan.workers, shards, plan.granularity.to_dict()]).encode())
    return h.hexdigest()[:16]
