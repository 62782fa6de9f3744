"""Training jobs: how does a job of replicas, workers and shards train, stop and resume?
Config, placement of roles on hosts, the replica's step loop, the shard and
Sandblaster roles, the run directory, launching (locally or under torchrun), run reports.

Names are imported on first use, so the command line's `--help` does not load torch.
"""

import importlib
from typing import Any

_WHERE = {
    "TrainConfig": "config",
    "train": "launch",
    "train_under_torchrun": "launch",
    "TrainSummary": "rundir",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"netpart.train.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'netpart.train' has no attribute {name!r}")
