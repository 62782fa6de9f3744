"""Errors a user can cause. The CLI turns each into one line on stderr and exit code 2."""

from __future__ import annotations

__all__ = ["MetisError", "NetpartError", "PlanError", "RuntimeFailure", "SpecError"]


class NetpartError(Exception):
    """Bad input: the message says what is wrong, where, and how to fix it, on one line."""


class SpecError(NetpartError):
    """A model spec that cannot be read or describes an impossible network."""


class PlanError(NetpartError):
    """A partition request or plan file that does not fit the model or cannot be made."""


class MetisError(NetpartError):
    """METIS is missing, was handed an invalid graph, or reported a failure."""


class RuntimeFailure(Exception):
    """A run that failed while running (a worker died, a peer timed out): exit code 1."""
