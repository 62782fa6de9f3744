"""Every error a user can see, in one place, and how the command line ends for each.

Two families, two exit codes:

- `NetpartError` (exit 2): the user's input is wrong — a spec, a plan, a flag, a data file,
  a run directory. The message says what, where, and how to fix it, on one line, and it is
  raised before anything is written or any process starts.
- `RuntimeFailure` (exit 1): something failed while running — a process died, a peer hung
  past the timeout, a message broke the protocol. The message names the process and the cause.

A stop asked for by the user (SIGINT/SIGTERM) is neither: the command exits 130.
"""

from __future__ import annotations

import re

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INPUT",
    "EXIT_INTERRUPTED",
    "CalibrationError",
    "DataError",
    "MetisError",
    "NetpartError",
    "PeerError",
    "PlacementError",
    "PlanError",
    "ProtocolError",
    "RuntimeFailure",
    "ScheduleError",
    "ShapeMismatchError",
    "SpecError",
    "TrainError",
    "WorkerFailure",
    "transport_reason",
    "write_reason",
]

EXIT_FAILURE, EXIT_INPUT, EXIT_INTERRUPTED = 1, 2, 130


class NetpartError(Exception):
    """Bad input: the message says what is wrong, where, and how to fix it, on one line."""


class SpecError(NetpartError):
    """A model spec that cannot be read or describes an impossible network."""


class PlanError(NetpartError):
    """A partition request or plan file that does not fit the model or cannot be made."""


class MetisError(NetpartError):
    """METIS is missing, was handed an invalid graph, or reported a failure."""


class ScheduleError(NetpartError):
    """A halo schedule whose sends and receives do not pair up, or that contradicts its plan."""


class ShapeMismatchError(ScheduleError):
    """A message or buffer whose length differs from what the schedule says."""


class DataError(NetpartError):
    """A data source that cannot be read or does not fit the model."""


class PlacementError(NetpartError):
    """A placement of roles on hosts that cannot be made (wrong process count, policy)."""


class TrainError(NetpartError):
    """A training request, run directory or checkpoint that cannot be used."""


class RuntimeFailure(Exception):
    """A run that failed while running (a worker died, a peer timed out): exit code 1."""


class CalibrationError(RuntimeFailure):
    """A calibration that cannot be trusted: the machine was busy while it measured."""


class PeerError(RuntimeFailure):
    """A peer died, hung past the timeout, or broke the protocol."""


class ProtocolError(RuntimeFailure):
    """A parameter-server message whose header disagrees with the layout."""


class WorkerFailure(RuntimeFailure):
    """A process of a job failed; the message names it and carries its last error line."""


def transport_reason(exc: BaseException) -> str:
    """A torch.distributed (gloo) error as one short line: no source location, no advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


def write_reason(exc: OSError) -> str:
    """A failed file write as one short line naming the file (disk full, read-only)."""
    where = f" {exc.filename}" if exc.filename else ""
    return f"writing{where} failed: {exc.strerror or exc}"
