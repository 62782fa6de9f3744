"""Planner benchmark: wall time and peak memory of planning, and plan quality.

Every case runs the default method, `auto`, in a fresh subprocess (so its peak RSS is its
own): the seconds `netpart.partition.plan` took, the seconds the whole process took (imports
included) and its peak RSS; for the acceptance case also `netpart plan ... --no-figures`, the
command a user runs. Cases: image-80m, image-330m and image-1.7b at 16, 64, 128 and 512
workers, speech at 8 to 128. For the image models at 16, 64 and 128 every candidate auto
weighed (volume / bound, imbalance, predicted step); for speech at 8 auto against stripe.
Each plan's digest (its node map and the winner's metrics) and its node map's own are
recorded; with `--baseline DIR` the same plans are made by the netpart of another checkout,
and the digests compared (its times are reported beside ours, not judged).

    python benchmarks/plan_bench.py --out benchmarks/results/plan_bench.json
    python benchmarks/plan_bench.py --baseline /tmp/old --out ...   # digests against it
    python benchmarks/plan_bench.py --quick      # smaller set, for a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import parser, write_results

IMAGE_MODELS = ["image-80m", "image-330m", "image-1.7b"]
IMAGE_WORKERS = [16, 64, 128, 512]
QUALITY_WORKERS = [16, 64, 128]
SPEECH_WORKERS = [8, 16, 32, 64, 128]
ACCEPT = ("image-1.7b", 128, 15.0, 2.5)  # model, workers, seconds, GiB
LARGE = ("image-1.7b", 512, 60.0, 8.0)


def _figures(m) -> dict:
    return {
        "volume": m.volume,
        "lower_bound": m.lower_bound,
        "volume_ratio": m.volume_ratio,
        "max_layer_imbalance": m.max_layer_imbalance,
        "predicted_step_s": m.predicted_step_s,
    }


def _child(model: str, workers: int, method: str, started: float) -> None:
    """Run one plan in this process and print its figures as JSON (used via subprocess)."""
    from netpart.models import load_spec
    from netpart.partition import plan

    spec = load_spec(model)
    start = time.perf_counter()
    p = plan(spec, workers, method)
    wall = time.perf_counter() - start
    metrics = json.dumps(dataclasses.asdict(p.metrics), sort_keys=True)
    digest = hashlib.sha256(p.node_map.astype("int64").tobytes() + metrics.encode())
    out = {
        "model": model,
        "workers": workers,
        "method": method,
        "chosen": p.method,
        "options": p.method_options,
        "plan_s": wall,
        "process_s": time.time() - started,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "blocks": len(p.node_map),
        "digest": digest.hexdigest()[:16],
        "map_digest": hashlib.sha256(p.node_map.astype("int64").tobytes()).hexdigest()[:16],
        **_figures(p.metrics),
        "candidates": [
            {
                "method": c.method,
                "options": c.options,
                "skipped": getattr(c, "skipped", ""),
                **_figures(c.metrics),
            }
            for c in p.candidates
        ],
    }
    print(json.dumps(out))


def _run(model: str, workers: int, method: str = "auto", tree: Path | None = None) -> dict:
    """One case in a fresh process; `tree`: plan with the netpart of that checkout."""
    env, cwd = dict(os.environ), None
    if tree is not None:  # `python FILE` imports from the file's folder first: set both
        env["PYTHONPATH"], cwd = str(tree), tree
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        model,
        str(workers),
        method,
        str(time.time()),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=3600, check=False, env=env, cwd=cwd
    )
    if res.returncode != 0:
        raise SystemExit(f"case {model} x {workers} ({method}) failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


PEAK = (
    "import resource, sys; from netpart.cli import main; code = main(sys.argv[1:]); "
    "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
    "sys.exit(code)"
)


def _command(model: str, workers: int) -> dict:
    """`netpart plan --model M --workers N --no-figures` as a user runs it (its entry point,
    `netpart.cli.main`, in a fresh process): wall and peak RSS."""
    argv = ["plan", "--model", model, "--workers", str(workers), "--no-figures"]
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", PEAK, *argv], capture_output=True, text=True, timeout=3600
    )
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"netpart plan {model} x {workers} failed:\n{res.stderr[-2000:]}")
    peak = next(int(x.split()[1]) for x in res.stderr.splitlines() if x.startswith("peak "))
    return {
        "model": model,
        "workers": workers,
        "wall_s": wall,
        "peak_rss_gib": peak / 2**20,
        "first_line": res.stdout.splitlines()[0],
    }


def _name(c: dict) -> str:
    return c["method"] + "".join(f" {k}={v}" for k, v in c["options"].items())


def _quality_lines(r: dict) -> list[str]:
    lines = []
    for c in r["candidates"]:
        mark = "*" if (c["method"], c["options"]) == (r["chosen"], r["options"]) else " "
        step = ("> " if c.get("skipped") else "") + f"{c['predicted_step_s'] * 1e3:.1f}"
        lines.append(
            f"{r['model']:<12} {r['workers']:>4} {mark}{_name(c):<19} {c['volume_ratio']:>10.3f} "
            f"{c['max_layer_imbalance']:>10.3f} {step:>9}"
        )
    return lines


def _checks(timed: list[dict], commands: list[dict], speech: dict, stripe: dict) -> list[str]:
    """The acceptance figures, one line each, with ok / MISSED."""
    lines = []
    for cmd in commands:
        for model, workers, seconds, gib in (ACCEPT, LARGE):
            if (cmd["model"], cmd["workers"]) == (model, workers):
                ok = cmd["wall_s"] <= seconds and cmd["peak_rss_gib"] <= gib
                lines.append(
                    f"netpart plan --model {model} --workers {workers} --no-figures: "
                    f"{cmd['wall_s']:.1f} s, {cmd['peak_rss_gib']:.2f} GiB "
                    f"{'ok' if ok else 'MISSED'} (<= {seconds:g} s, {gib:g} GiB)"
                )
    ok = speech["predicted_step_s"] <= stripe["predicted_step_s"]
    lines.append(
        f"speech x 8: auto ({speech['chosen']}) step {speech['predicted_step_s'] * 1e3:.2f} ms vs "
        f"stripe {stripe['predicted_step_s'] * 1e3:.2f} ms {'ok' if ok else 'MISSED'}"
    )
    skipped = sum(bool(c.get("skipped")) for r in timed for c in r["candidates"])
    lines.append(f"candidates skipped by the screen: {skipped}")
    return lines


def _compare(timed: list[dict], baseline: Path) -> list[str]:
    """Each quality point and speech x 8 planned by the baseline checkout too: the digests."""
    lines = []
    for r in timed:
        if r["workers"] not in QUALITY_WORKERS and r["model"] != "speech":
            continue
        if r["model"] == "speech" and r["workers"] != 8:
            continue
        old = _run(r["model"], r["workers"], tree=baseline)
        same = old["digest"] == r["digest"]
        maps = "same node map" if old.get("map_digest") == r["map_digest"] else "other node map"
        if old.get("map_digest") is None:  # a baseline from before map digests
            maps = "node map not compared"
        lines.append(
            f"{r['model']} x {r['workers']}: winner {r['chosen']} {r['digest']} vs baseline "
            f"{old['chosen']} {old['digest']}: {'same' if same else 'DIFFERENT'} ({maps}); plan "
            f"{r['plan_s']:.1f} s vs {old['plan_s']:.1f} s, {r['peak_rss_gib']:.2f} vs "
            f"{old['peak_rss_gib']:.2f} GiB"
        )
    return lines


def main() -> int:
    ap = parser("plan_bench", __doc__)  # --quick: only image-80m x 16 and speech x 8
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout to compare with")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2], float(args.child[3]))
        return 0
    cases = [(m, n) for m in IMAGE_MODELS for n in IMAGE_WORKERS]
    cases += [("speech", n) for n in SPEECH_WORKERS]
    if args.quick:
        cases = [("image-80m", 16), ("speech", 8)]
    timed = []
    print(f"{'case':<20} {'plan s':>8} {'process s':>10} {'peak GiB':>9} {'blocks':>8}  chosen")
    for model, workers in cases:
        r = _run(model, workers)
        timed.append(r)
        print(
            f"{model + ' x ' + str(workers):<20} {r['plan_s']:>8.2f} {r['process_s']:>10.2f} "
            f"{r['peak_rss_gib']:>9.2f} {r['blocks']:>8}  {r['chosen']}"
        )
    commands = [] if args.quick else [_command(*ACCEPT[:2]), _command(*LARGE[:2])]
    for c in commands:
        print(
            f"netpart plan {c['model']} x {c['workers']}: {c['wall_s']:.1f} s, "
            f"{c['peak_rss_gib']:.2f} GiB"
        )
    print(
        f"\n{'model':<12} {'P':>4} {'candidate':<20} {'vol/bound':>10} {'imbalance':>10} "
        f"{'step ms':>9}"
    )
    quality = [r for r in timed if r["model"] in IMAGE_MODELS and r["workers"] in QUALITY_WORKERS]
    for r in quality:
        print("\n".join(_quality_lines(r)))
    speech = next(r for r in timed if (r["model"], r["workers"]) == ("speech", 8))
    stripe = _run("speech", 8, "stripe")
    checks = _checks(timed, commands, speech, stripe)
    if args.baseline is not None:
        checks += _compare(timed, args.baseline)
    print("\nacceptance:")
    for line in checks:
        print("  " + line)
    result = {
        "timed": timed,
        "commands": commands,
        "speech_stripe": stripe,
        "acceptance": checks,
    }
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
