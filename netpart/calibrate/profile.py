"""The profile file `netpart calibrate` writes, and what it says on the console: the fitted
model (what `--profile` reads), every measurement it was fitted to, the machine's load while
it ran, the predictions set against measured steps, and the verdict on all of it
(`netpart.calibrate.trust`).
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from netpart.calibrate.measure import PROBE_SWING, SCHEMA_VERSION
from netpart.cost.machine import Machine
from netpart.cost.sheet import MachineSheet

__all__ = ["check_lines", "host_machine", "profile_json", "profile_lines"]


def profile_lines(model: Machine, details: dict) -> list[str]:
    """What a calibration fitted, in a few lines for the console (with a warning where the
    machine's speed moved while it was measured)."""
    out = []
    for kind, cost in model.kinds.items():
        (f0, t0), (f1, t1) = cost.points[0], cost.points[-1]
        per_value = f", +{cost.per_value * 1e9:.2f} ns per input value" if cost.per_value else ""
        out.append(
            f"{kind:<6} {len(cost.points):3d} slices: {t0 * 1e6:8.1f} µs at {f0 / 1e6:9.3f} MFLOP "
            f"... {t1 * 1e3:8.2f} ms at {f1 / 1e9:7.2f} GFLOP ({f1 / t1 / 1e9:.1f} GFLOP/s)"
            f"{per_value}"
        )
    fitted, gather = model.collective_s * 1e3, model.gather_s(2) * 1e3
    out.append(
        f"exchange: {model.latency_s * 1e6:.0f} µs a phase in a step, "
        f"{model.bandwidth_bps / 1e9:.2f} Gbit/s (tables for "
        f"{'/'.join(str(k) for k in sorted(model.link))} peers); per step "
        f"{model.step_fixed_s * 1e3:.2f} ms; with N = 2 +{gather:.2f} ms (the loss's collective, "
        f"measured) +{fitted:.2f} ms (fitted) and compute x{1 + model.parallel_slowdown:.2f}"
    )
    if details.get("anchored"):
        out.append(
            "layer tables scaled to each model's one-process step (its slices timed alone: "
            "x1.00): " + ", ".join(f"{m} x{f:.2f}" for m, f in details["anchored"].items())
        )
    low, high = details["probe_spread"]
    out.append(f"speed probe over the runs: 10th-90th percentile {low:.2f}-{high:.2f}x its median")
    if high / low > PROBE_SWING:
        out.append(
            f"warning: the machine's speed moved {high / low:.2f}x while it was calibrated; "
            "predictions from this profile may be off by as much: calibrate again when it is "
            "quiet (nothing else running)"
        )
    for n, slowdown, seconds in model.crowd:
        out.append(
            f"with N = {n:g}: compute x{1 + model.parallel_slowdown + slowdown:.2f}, "
            f"{seconds * 1e3:+.2f} ms a step beyond N = 2's terms (steps measured at {n:g})"
        )
    return out


def host_machine(model: Machine) -> MachineSheet:
    """This host as `model` measured it: a machine description (absolute figures) named
    after the host, stating when and with which torch."""
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    about = (
        f"{platform.node()} as `netpart calibrate` measured it on {when} (torch "
        f"{torch.__version__}): one worker on one thread; the link between two "
        "processes of this host"
    )
    return MachineSheet.from_machine(
        model,
        name=platform.node() or "this-host",
        about=about,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    )


def profile_json(model: Machine, details: dict) -> str:
    """The profile file: the model (what `--profile` reads), the machine description it
    makes (what `--machine` reads), and what it was fitted to."""
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "host": platform.node(),
            "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": model.to_dict(),
            "machine": host_machine(model).to_dict(),
            "measurements": details,
        },
        indent=1,
    )


def check_lines(details: dict) -> list[str]:
    """The predictions against measured steps, one line a case (the model not fitted on
    marked), and the median error of each group."""
    rows = details.get("check", [])
    if not rows:
        return []
    out = [f"predicted vs measured step (ms), batch {details.get('batch')}:"]
    for r in rows:
        ratio = r["measured_s"] / r["predicted_s"] if r["predicted_s"] else float("nan")
        tag = "" if r["fitted"] else "  (not fitted on)"
        case = f"{r['model']} x {r['workers']}"
        out.append(
            f"  {case:<20} predicted {r['predicted_s'] * 1e3:8.2f}, measured "
            f"{r['measured_s'] * 1e3:8.2f}, ratio {ratio:.2f}{tag}"
        )
    return out
