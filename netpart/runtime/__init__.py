"""Runtime: halo schedules, model workers, transports, parameter-server shards, launchers."""

from netpart.runtime.config import TrainConfig, TrainError
from netpart.runtime.launch import WorkerFailure, run_step
from netpart.runtime.ps import ShardServer
from netpart.runtime.ps_client import ShardClient
from netpart.runtime.result import StepResult
from netpart.runtime.schedule import (
    HaloSchedule,
    Instruction,
    ScheduleError,
    ShapeMismatchError,
    build_schedule,
)
from netpart.runtime.train_launch import TrainSummary, train
from netpart.runtime.transport import GlooTransport, PeerError, Transport
from netpart.runtime.updates import Optimizer, UpdateRule
from netpart.runtime.worker import ModelWorker

__all__ = [
    "GlooTransport",
    "HaloSchedule",
    "Instruction",
    "ModelWorker",
    "Optimizer",
    "PeerError",
    "ScheduleError",
    "ShapeMismatchError",
    "ShardClient",
    "ShardServer",
    "StepResult",
    "TrainConfig",
    "TrainError",
    "TrainSummary",
    "Transport",
    "UpdateRule",
    "WorkerFailure",
    "build_schedule",
    "run_step",
    "train",
]
