"""Model-parallel execution: layer slices, the worker that interprets a schedule's program,
transports, the one process launcher, `run_step` and `check`."""

from netpart.errors import PeerError, WorkerFailure
from netpart.runtime.result import StepResult
from netpart.runtime.step import run_step
from netpart.runtime.transport import GlooTransport, Transport
from netpart.runtime.worker import ModelWorker, WorkerResult

__all__ = [
    "GlooTransport",
    "ModelWorker",
    "PeerError",
    "StepResult",
    "Transport",
    "WorkerFailure",
    "WorkerResult",
    "run_step",
]
