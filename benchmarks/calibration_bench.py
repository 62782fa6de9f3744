"""Predicted against measured step time with a profile from `netpart calibrate` (issue 17).

Calibrates this machine twice — on every benchmark model, and on a subset that leaves the
MLP and bench-local-wide out (their predictions are then out of sample) — and then runs
`netpart run --profile` for each (model, workers) case, the cases alternating, ROUNDS times.
Prints and saves the median measured / predicted ratio per case and profile, and per run how
much slower than at calibration the machine ran (`netpart run`'s `slowdown`, its speed probe
against the profile's).

    python benchmarks/calibration_bench.py [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [(m, n) for m in ("digits-mlp", "bench-local", "bench-local-wide") for n in (1, 2)]
PROFILES = {
    "all": "tiny-mlp,digits-mlp,tiny-local,bench-local,bench-local-wide",
    "held-out": "tiny-mlp,tiny-local,bench-local",
}


def netpart(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "netpart", *args], check=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="netpart run's (default: its own)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/calibration_bench.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="calibration-bench-"))
    results: dict = {}
    for name, models in PROFILES.items():
        profile = tmp / f"{name}.json"
        netpart("calibrate", "--out", str(profile), "--models", models)
        print(f"profile {name}: calibrated on {models}", flush=True)
        rows = {f"{m}/{n}": [] for m, n in CASES}
        for r in range(args.rounds):
            for m, n in CASES:
                stats = tmp / "stats.json"
                steps = [] if args.steps is None else ["--steps", str(args.steps)]
                netpart(
                    "run",
                    "--model",
                    m,
                    "--workers",
                    str(n),
                    *steps,
                    "--profile",
                    str(profile),
                    "--stats",
                    str(stats),
                )
                s = json.loads(stats.read_text())
                rows[f"{m}/{n}"].append(
                    [s["step_s_median"], s["predicted_step_s"], s["slowdown"] or 0.0]
                )
            print(f"  round {r + 1} done", flush=True)
        results[name] = {"models": models, "cases": {}}
        for key, pairs in rows.items():
            ratios = [meas / pred for meas, pred, _ in pairs]
            med = statistics.median(ratios)
            results[name]["cases"][key] = {
                "measured_ms": [p[0] * 1e3 for p in pairs],
                "predicted_ms": [p[1] * 1e3 for p in pairs],
                "slowdown": [p[2] for p in pairs],
                "ratio_median": med,
                "within_15pct": abs(med - 1) <= 0.15,
            }
            print(
                f"  {key:<20} measured/predicted {med:.2f} (rounds: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}; the machine's speed probe at "
                f"{', '.join(f'{p[2]:.2f}' for p in pairs)}x its calibrated time)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
