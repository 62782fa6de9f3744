"""Planner benchmark: wall time and peak memory of `netpart.partition.plan`, and plan quality.

Each timed case runs in a fresh subprocess so its peak RSS is its own. Quality cases report
volume / lower bound, max layer imbalance and predicted step time of metis and tiles on the
image models, and metis vs stripe predicted step time on speech. Prints tables, writes JSON.

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

TIMED = [("image-1.7b", 81), ("image-1.7b", 128), ("speech", 8)]
QUALITY_WORKERS = [16, 64, 128]
IMAGE_MODELS = ["image-80m", "image-330m", "image-1.7b"]


def _child(model: str, workers: int, method: str) -> None:
    """Run one plan in this process and print its figures as JSON (used via subprocess)."""
    from netpart.models import load_spec
    from netpart.partition import plan

    spec = load_spec(model)
    start = time.perf_counter()
    p = plan(spec, workers, method)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = p.metrics
    print(
        json.dumps(
            {
                "model": model,
                "workers": workers,
                "method": method,
                "wall_s": wall,
                "peak_rss_gib": peak_kib / 2**20,
                "blocks": len(p.node_map),
                "volume": m.volume,
                "lower_bound": m.lower_bound,
                "volume_ratio": m.volume_ratio,
                "max_layer_imbalance": m.max_layer_imbalance,
                "predicted_step_s": m.predicted_step_s,
            }
        )
    )


def _run(model: str, workers: int, method: str = "metis") -> dict:
    cmd = [sys.executable, __file__, "--child", model, str(workers), method]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if res.returncode != 0:
        raise SystemExit(f"case {model} x {workers} ({method}) failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


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
        f"\n{'model':<12} {'P':>4} {'method':>7} {'vol/bound':>10} {'imbalance':>10} "
        f"{'step ms':>8} {'wall s':>8}"
    )
    for model in models:
        for workers in workers_list:
            for method in ("metis", "tiles"):
                r = _run(model, workers, method)
                quality.append(r)
                print(
                    f"{model:<12} {workers:>4} {method:>7} {r['volume_ratio']:>10.3f} "
                    f"{r['max_layer_imbalance']:>10.3f} {r['predicted_step_s'] * 1e3:>8.1f} "
                    f"{r['wall_s']:>8.2f}"
                )

    speech_metis = next((r for r in timed if r["model"] == "speech"), None) or _run("speech", 8)
    speech_stripe = _run("speech", 8, "stripe")
    ratio = speech_metis["predicted_step_s"] / speech_stripe["predicted_step_s"]
    print(
        f"\nspeech x 8: metis step {speech_metis['predicted_step_s'] * 1e3:.2f} ms, "
        f"stripe {speech_stripe['predicted_step_s'] * 1e3:.2f} ms, ratio {ratio:.3f}"
    )

    result = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "timed": timed,
        "quality": quality,
        "speech_metis_over_stripe_step": ratio,
        "speech_stripe": speech_stripe,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
