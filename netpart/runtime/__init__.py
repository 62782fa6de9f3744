"""Model-parallel runtime: halo schedules, model workers, transports, process launch."""

from netpart.runtime.launch import WorkerFailure, run_step
from netpart.runtime.result import StepResult
from netpart.runtime.schedule import (
    HaloSchedule,
    Instruction,
    ScheduleError,
    ShapeMismatchError,
    build_schedule,
)
from netpart.runtime.transport import GlooTransport, PeerError, Transport
from netpart.runtime.worker import ModelWorker

__all__ = [
    "GlooTransport",
    "HaloSchedule",
    "Instruction",
    "ModelWorker",
    "PeerError",
    "ScheduleError",
    "ShapeMismatchError",
    "StepResult",
    "Transport",
    "WorkerFailure",
    "build_schedule",
    "run_step",
]
