"""Figures with units: the one parser of the quantities a machine is described in.

A machine description's figures (`netpart.cost.sheet`: '95 GFLOP/s', '1 Gbit/s', '50 us',
'48 GiB'), `--net`'s (`bandwidth=10Gbit,latency=20us,flops=50G`) and a profile's (plain SI
numbers, written by `netpart calibrate`) all read through `quantity`. A description states
every unit; `--net` may leave the unit's name out where the prefix says enough ('50G' FLOP/s,
'10Gbit', a latency in seconds).
"""

from __future__ import annotations

import math
import re

__all__ = ["EXAMPLES", "quantity"]

PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
# each unit's name (as a regex) and, where a figure may leave it out, what stands for it
NAMES = {
    "rate": r"flop/s|flops?(?:/s)?",
    "bits": r"bit/s|bits?(?:/s|ps)?|b(?:/s|ps)?",
    "time": r"s|ms|us|µs|ns",
    "bytes": r"i?b",
}
EXAMPLES = {
    "rate": "a compute rate, e.g. '95 GFLOP/s'",
    "bits": "a bandwidth, e.g. '1 Gbit/s'",
    "time": "a time, e.g. '50 us'",
    "bytes": "a size, e.g. '48 GiB'",
}
_STRICT = {"rate": r"flop/s", "bits": r"bit/s", "time": NAMES["time"], "bytes": r"i?b"}


def quantity(text: str, unit: str, *, named: bool = True) -> float:
    """`text` ('95 GFLOP/s', '50 us', '48 GiB') in SI units (bytes for a size). `named`: the
    unit's name must be there (a machine description); otherwise it may be left out ('50G',
    '10Gbit', '0.002'). ValueError if it does not read as one, or is negative or not finite."""
    names = _STRICT[unit] if named else NAMES[unit]
    m = re.fullmatch(
        r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgtpµu]?)\s*("
        + names
        + r")"
        + ("" if named else "?")
        + r"\s*",
        text,
        flags=re.IGNORECASE,
    )
    if not m:
        raise ValueError(f"{text!r} is not {EXAMPLES[unit]}")
    number, prefix = float(m.group(1)), m.group(2).lower().replace("µ", "u")
    suffix = (m.group(3) or "").lower().replace("µ", "u")
    if unit == "time":
        name = (prefix + suffix).replace("µ", "u") or "s"
        if name not in TIME:
            raise ValueError(f"{text!r} is not {EXAMPLES[unit]}")
        value = number * TIME[name]
    elif unit == "bytes":
        value = number * (BINARY if suffix == "ib" else PREFIX)[prefix]
    else:
        value = number * PREFIX[prefix]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} must be >= 0")
    return value
