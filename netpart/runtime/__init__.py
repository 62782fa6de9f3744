"""Model-parallel execution: how do N workers run one step of a split model? Layer slices,
the worker that interprets its compiled program, transports, `run_step` and `check`.

Names are imported on first use: the launcher's preloaded interpreter starts before torch is
loaded.
"""

import importlib
from typing import Any

_WHERE = {
    "GlooTransport": "netpart.runtime.transport",
    "ModelWorker": "netpart.runtime.worker",
    "PeerError": "netpart.errors",
    "StepOptions": "netpart.runtime.step",
    "StepResult": "netpart.runtime.result",
    "Transport": "netpart.runtime.transport",
    "WorkerFailure": "netpart.errors",
    "WorkerResult": "netpart.runtime.state",
    "run_step": "netpart.runtime.step",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'netpart.runtime' has no attribute {name!r}")
