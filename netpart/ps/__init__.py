"""The parameter server: where do a model's parameters live between replicas, and how are
they updated? Wire protocol, shard server (and how it serves its peers), the
policy of each mode (Downpour, sync, Sandblaster), update rules, the worker's client,
Sandblaster's coordinator messages, checkpoints, and shard-side L-BFGS vectors.

Names are imported on first use, so `netpart.ps.optimizer` (read by configs and the command
line) does not load torch.
"""

import importlib
from typing import Any

_WHERE = {
    "ShardClient": "client",
    "ShardCommands": "commands",
    "UnitChannel": "commands",
    "Downpour": "modes",
    "Mode": "modes",
    "Push": "modes",
    "Response": "modes",
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
