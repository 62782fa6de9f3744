"""The parameter server: wire protocol, shard server, per-mode behaviour (Downpour, sync,
Sandblaster), update rules, the worker's client, checkpoints, and shard-side L-BFGS vectors.

Names are imported on first use, so `netpart.ps.optimizer` (read by configs and the command
line) does not load torch.
"""

import importlib
from typing import Any

_WHERE = {
    "ShardClient": "client",
    "Downpour": "modes",
    "Mode": "modes",
    "Sandblaster": "modes",
    "Sync": "modes",
    "OPTIMIZERS": "optimizer",
    "Optimizer": "optimizer",
    "DelayCompensation": "rules",
    "make_rule": "rules",
    "ShardServer": "server",
    "ShardSetup": "server",
    "ShardState": "server",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"netpart.ps.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'netpart.ps' has no attribute {name!r}")
