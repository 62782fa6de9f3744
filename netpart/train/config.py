"""TrainConfig: everything a training job needs besides the spec and the plan, validated once.

Schema (`train.json` in the run directory, next to `spec.json`, `plan.json`, `node_map.npy`):
  schema_version  1
  model, fingerprint   the spec's name and fingerprint (a resume must match)
  layout          hash of the node map, granularity, workers and shards (a resume must match)
  config          the fields of TrainConfig below
Ranks of a job: on one machine, worker w of replica r is rank r * workers + w and shard s is
rank R * workers + s; across machines `placement` decides (netpart.train.placement).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
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
    "MAX_SEED",
    "MAX_TIMEOUT",
    "MIN_TIMEOUT",
    "MODES",
    "SCHEMA_VERSION",
    "TrainConfig",
    "TrainError",
    "layout_key",
]

SCHEMA_VERSION = 1
MODES = ("downpour", "sync", "sandblaster")
LOCAL_UPDATE = ("auto", "on", "off")
INITS = ("seed", "module")  # netpart's seeded initial weights, or the user's module's
# Adagrad's is torch.optim.Adagrad's: Adagrad's first steps move every weight by about lr
# at once, and larger rates made image models' losses spike by orders of magnitude before
# they recovered (docs/training.md). L-BFGS's is torch.optim.LBFGS's.
DEFAULT_LR = {"adagrad": 0.01, "sgd": 0.05, "lbfgs": 1.0}


@dataclass(frozen=True)
class TrainConfig:
    replicas: int = 2
    shards: int = 1
    mode: str = "downpour"  # downpour | sync | sandblaster
    optimizer: str = "adagrad"  # sgd | adagrad
    lr: float | None = None  # None: DEFAULT_LR of the optimizer
    n_fetch: int = 1
    n_push: int = 1
    steps: int = 100
    batch: int = 32
    warm_start: int = 0  # steps replica 0 trains alone (downpour)
    checkpoint_every: int = 50  # shard updates between checkpoints
    snapshot_every: int = 0  # shard updates between kept snapshots (0: none), for curves
    seed: int = 0
    data: str = "synthetic"
    data_layout: str = "nchw"  # an image model's .npz arrays: nchw, or nhwc (transposed)
    examples: int = 60000  # synthetic dataset size
    dtype: str = "float32"
    timeout: float = 60.0  # seconds a replica waits for a peer in the halo exchange
    threads: int = 1
    placement: str = "pack"  # pack | spread | ordered (see netpart.train.placement)
    dc_lambda: float = 0.0  # downpour: DC-ASGD delay compensation strength (0: off)
    units: int = 16  # sandblaster: work units per batch (steps = L-BFGS iterations)
    history: int = 10  # sandblaster: L-BFGS curvature pairs kept in the shards
    line_search: str = "armijo"  # sandblaster: armijo | none (torch.optim.LBFGS's fixed step)
    push_norm: float = 0.0  # downpour: also push once the gradient's L2 norm reaches this
    local_update: str = "auto"  # downpour: each step also applied by the replica (see below)
    restarts: int = 3  # times a shard that dies is restarted from its last checkpoint
    eval_every: int = 0  # replica 0 evaluates on held-out data every K steps (0: at the end only)
    log: str = ""  # comma-separated loggers besides the run's JSON lines: csv, tensorboard
    init: str = "seed"  # seed | module: the initial weights (module: the user's, initial.pt)

    def __post_init__(self) -> None:
        if self.lr is None and self.optimizer in DEFAULT_LR:
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])
        for name in (
            "replicas",
            "shards",
            "n_fetch",
            "n_push",
            "batch",
            "checkpoint_every",
            "units",
            "history",
        ):
            _at_least(name, getattr(self, name), 1)
        for name in ("steps", "warm_start", "snapshot_every", "restarts", "eval_every"):
            _at_least(name, getattr(self, name), 0)
        _at_least("threads", self.threads, 1)
        if self.mode not in MODES:
            raise TrainError(f"--mode {self.mode}: choose one of {', '.join(MODES)}")
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"--optimizer {self.optimizer}: choose one of {', '.join(OPTIMIZERS)}")
        for name in ("lr", "dc_lambda", "push_norm", "timeout"):
            if not math.isfinite(getattr(self, name)):
                flag = "--" + name.replace("_", "-")
                raise TrainError(f"{flag} {getattr(self, name)}: must be a finite number")
        if not self.lr > 0:
            raise TrainError(f"--lr {self.lr}: the learning rate must be > 0")
        if self.dtype not in DTYPE_NAMES:
            raise TrainError(f"dtype {self.dtype}: choose one of {', '.join(DTYPE_NAMES)}")
        if self.placement not in POLICIES:
            raise TrainError(f"--placement {self.placement}: choose one of {', '.join(POLICIES)}")
        for name in ("dc_lambda", "push_norm"):
            if not getattr(self, name) >= 0:
                flag = "--" + name.replace("_", "-")
                raise TrainError(f"{flag} {getattr(self, name)}: must be >= 0")
        self._check_modes()

    def _check_modes(self) -> None:
        """The checks of options that only some modes take, and of the job's surroundings
        (loggers, data layout, timeout, seed)."""
        if self.mode == "sync" and (self.dc_lambda or self.push_norm):
            raise TrainError(
                "--dc-lambda and --push-norm apply to --mode downpour (sync pushes every step, "
                "and its gradients are never stale)"
            )
        if self.init not in INITS:
            raise TrainError(f"--init {self.init}: choose seed or module")
        if self.local_update not in LOCAL_UPDATE:
            raise TrainError(f"--local-update {self.local_update}: choose auto, on or off")
        if self.local_update == "on" and not self._local_defined:
            raise TrainError(
                "--local-update on needs --mode downpour and --optimizer sgd without --dc-lambda "
                "(the replica applies p -= lr * g itself, as the shards' SGD does)"
            )
        if (self.mode == "sandblaster") != (self.optimizer == "lbfgs"):
            raise TrainError(
                "--mode sandblaster goes with --optimizer lbfgs, and lbfgs only with sandblaster"
            )
        for name in self.loggers:
            if name not in ("csv", "tensorboard"):
                raise TrainError(f"--log {name}: choose from csv, tensorboard (comma-separated)")
        if self.data_layout not in ("nchw", "nhwc"):
            raise TrainError(f"--layout {self.data_layout}: choose nchw or nhwc")
        if self.line_search not in ("armijo", "none"):
            raise TrainError(f"--line-search {self.line_search}: choose armijo or none")
        if self.mode == "sandblaster" and self.eval_every:
            raise TrainError(
                "--eval-every applies to downpour and sync (sandblaster.jsonl "
                "has every L-BFGS evaluation's loss)"
            )
        if self.mode == "sandblaster" and self.units > self.batch:
            raise TrainError(f"--units {self.units}: at most --batch {self.batch} units")
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise TrainError(
                f"--timeout {self.timeout}: give {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} seconds"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not (0 <= self.seed <= MAX_SEED)
        ):
            raise TrainError(f"--seed {self.seed}: give an integer from 0 to {MAX_SEED}")

    @property
    def start_timeout(self) -> float:
        """Seconds every process of a job has to start (join the group and learn its role;
        healthy ones take about one): --timeout, at least START_MIN_S."""
        return max(START_MIN_S, self.timeout)

    @property
    def _local_defined(self) -> bool:
        return self.mode == "downpour" and self.optimizer == "sgd" and self.dc_lambda == 0

    @property
    def local_steps(self) -> bool:
        """Whether a Downpour replica applies each step to its own parameters (the paper's
        client: p -= lr * g) and brings fetched values up to date with its pushes they do not
        reflect yet: with --local-update auto (the default) wherever the shards' rule is SGD
        and no delay compensation reads the versions served."""
        return self.local_update != "off" and self._local_defined

    @property
    def loggers(self) -> tuple[str, ...]:
        """The loggers `log` names (`netpart.train.loggers`)."""
        return tuple(x.strip() for x in self.log.split(",") if x.strip())

    @property
    def optim(self) -> Optimizer:
        return Optimizer(self.optimizer, self.lr)

    @property
    def coordinators(self) -> int:
        """Sandblaster has one coordinator process (the last rank on one machine)."""
        return 1 if self.mode == "sandblaster" else 0

    def world(self, workers: int) -> int:
        return self.replicas * workers + self.shards + self.coordinators

    def memory_job(self, workers: int) -> dict[str, Any]:
        """This job on `workers` workers as `netpart.planning.memory.estimate` reads it."""
        return {
            "batch": self.batch,
            "replicas": self.replicas,
            "processes": self.world(workers),
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "history": self.history,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, source: str = "train.json") -> TrainConfig:
        if not isinstance(data, dict):
            raise TrainError(f"{source}: config must be an object")
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise TrainError(f"{source}: unknown config fields {unknown}")
        return cls(**data)

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
