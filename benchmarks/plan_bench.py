"""Planner benchmark: wall time and peak memory of `netpart.partition.plan`, and plan quality.

Each case runs the default method, `auto`, in a fresh subprocess (so its peak RSS is its own)
and reports every candidate auto weighed: volume / lower bound, max layer imbalance and
predicted step of METIS on the unit graph, METIS on the layer-aligned graph, tiles (with its
default bands and two more), and the plan auto kept, on the image models at 16, 64 and 128
workers; on speech at 8 workers, auto's predicted step against stripe's. Prints the tables and
the acceptance checks, writes JSON.

    python benchmarks/plan_bench.py --out benchmarks/results/plan_bench.json
    python benchmarks/plan_bench.py --quick      # smaller set, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

TIMED = [("image-1.7b", 128), ("image-1.7b", 81), ("speech", 8)]
QUALITY_WORKERS = [16, 64, 128]
IMAGE_MODELS = ["image-80m", "image-330m", "image-1.7b"]


def _figures(m) -> dict:
    return {
        "volume": m.volume,
        "lower_bound": m.lower_bound,
        "volume_ratio": m.volume_ratio,
        "max_layer_imbalance": m.max_layer_imbalance,
        "predicted_step_s": m.predicted_step_s,
    }


def _child(model: str, workers: int, method: str) -> None:
    """Run one plan in this process and print its figures as JSON (used via subprocess)."""
    from netpart.models import load_spec
    from netpart.partition import plan

    spec = load_spec(model)
    start = time.perf_counter()
    p = plan(spec, workers, method)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "model": model,
        "workers": workers,
        "method": method,
        "chosen": p.method,
        "options": p.method_options,
        "wall_s": wall,
        "peak_rss_gib": peak_kib / 2**20,
        "blocks": len(p.node_map),
        **_figures(p.metrics),
        "candidates": [
            {"method": c.method, "options": c.options, **_figures(c.metrics)} for c in p.candidates
        ],
    }
    print(json.dumps(out))


def _run(model: str, workers: int, method: str = "auto") -> dict:
    cmd = [sys.executable, __file__, "--child", model, str(workers), method]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if res.returncode != 0:
        raise SystemExit(f"case {model} x {workers} ({method}) failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _name(c: dict) -> str:
    return c["method"] + "".join(f" {k}={v}" for k, v in c["options"].items())


def _checks(quality: list[dict], timed: list[dict], speech: dict, stripe: dict) -> list[str]:
    """The issue's acceptance figures, one line each, with ok / MISSED."""
    lines = []
    for r in quality:
        aligned = next(c for c in r["candidates"] if c["method"] == "metis-aligned")
        ok_a = aligned["volume_ratio"] <= 1.25 and aligned["max_layer_imbalance"] <= 1.05
        ok = r["volume_ratio"] <= 1.10 and r["max_layer_imbalance"] <= 1.05
        lines.append(
            f"{r['model']} x {r['workers']}: metis-aligned {aligned['volume_ratio']:.3f} / "
            f"{aligned['max_layer_imbalance']:.3f} {'ok' if ok_a else 'MISSED'} (<= 1.25, 1.05); "
            f"auto ({_name({'method': r['chosen'], 'options': r['options']})}) "
            f"{r['volume_ratio']:.3f} / {r['max_layer_imbalance']:.3f} "
            f"{'ok' if ok else 'MISSED'} (<= 1.10, 1.05)"
        )
    ok = speech["predicted_step_s"] <= stripe["predicted_step_s"]
    lines.append(
        f"speech x 8: auto ({speech['chosen']}) step {speech['predicted_step_s'] * 1e3:.2f} ms vs "
        f"stripe {stripe['predicted_step_s'] * 1e3:.2f} ms {'ok' if ok else 'MISSED'}"
    )
    for r in timed:
        if (r["model"], r["workers"]) == ("image-1.7b", 128):
            ok = r["wall_s"] <= 30 and r["peak_rss_gib"] <= 4
            lines.append(
                f"image-1.7b x 128 auto: {r['wall_s']:.1f} s, {r['peak_rss_gib']:.2f} GiB "
                f"{'ok' if ok else 'MISSED'} (<= 30 s, 4 GiB)"
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--quick", action="store_true", help="only image-80m and speech, 16 workers")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2])
        return 0

    timed_cases = [("speech", 8)] if args.quick else TIMED
    models = ["image-80m"] if args.quick else IMAGE_MODELS
    workers_list = [16] if args.quick else QUALITY_WORKERS

    timed = []
    print(f"{'case':<24} {'wall s':>8} {'peak GiB':>9} {'blocks':>8}")
    for model, workers in timed_cases:
        r = _run(model, workers)
        timed.append(r)
        print(
            f"{model + ' x ' + str(workers):<24} {r['wall_s']:>8.2f} {r['peak_rss_gib']:>9.2f} "
            f"{r['blocks']:>8}"
        )

    quality = []
    print(
        f"\n{'model':<12} {'P':>4} {'candidate':<20} {'vol/bound':>10} {'imbalance':>10} "
        f"{'step ms':>8}"
    )
    for model in models:
        for workers in workers_list:
            r = next((t for t in timed if (t["model"], t["workers"]) == (model, workers)), None)
            r = r or _run(model, workers)
            quality.append(r)
            for c in r["candidates"]:
                mark = "*" if (c["method"], c["options"]) == (r["chosen"], r["options"]) else " "
                print(
                    f"{model:<12} {workers:>4} {mark}{_name(c):<19} {c['volume_ratio']:>10.3f} "
                    f"{c['max_layer_imbalance']:>10.3f} {c['predicted_step_s'] * 1e3:>8.1f}"
                )
            print(f"{'':<12} {'':>4}  auto wall {r['wall_s']:.2f} s")

    speech = next((r for r in timed if r["model"] == "speech"), None) or _run("speech", 8)
    stripe = _run("speech", 8, "stripe")
    checks = _checks(quality, timed, speech, stripe)
    print("\nacceptance:")
    for line in checks:
        print("  " + line)

    result = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "timed": timed,
        "quality": quality,
        "speech_auto": speech,
        "speech_stripe": stripe,
        "acceptance": checks,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
