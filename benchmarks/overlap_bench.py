"""Halo overlap and the 2-worker speedup on emulated dedicated machines, side by side in one run.

On this machine's loopback a halo is a memory copy by gloo's threads on the cores that compute,
so splitting layers does not pay (docs/runtime.md). Here each worker has a machine of its own:
a network namespace behind a `tc tbf` link and a cpu cgroup held to a share of one core
(`netpart.calibrate.emulated`'s machines). Per model and round, alternating:

- `one`: the 1-worker step (one machine);
- `split`: the 2-worker step, every layer that qualifies split (interior units while the
  forward halo travels, weight gradients while the backward halo does), as across machines;
- `joined`: the same plan with no layer split (halo exchanged, then computed);
- `exchange`: the same plan running only its messages (what the bytes cost alone).

Figures (medians over rounds): speedup = one / split; the share of the exchange hidden =
1 - exposed(split) / exposed(joined), where exposed is a step's time blocked on halo
(`wait`, mean over the two workers, median per step); and per layer, each phase's exposed
and hidden milliseconds (worker 0's last step of the last round). Needs root.

    python benchmarks/overlap_bench.py --out benchmarks/results/overlap_bench.json  # ~6 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from netpart.calibrate.emulated import WARMUP, EmulatedRunner  # noqa: E402
from netpart.models import load_spec  # noqa: E402
from netpart.partition import plan  # noqa: E402

BATCH, STEPS = 32, 10
CASES = ("one", "split", "joined", "exchange")


def _case(runner: EmulatedRunner, spec, plans: dict, case: str) -> dict:
    """One run of one case: its median step (slowest worker) and, with two workers, the
    median `wait` per step (mean over workers) and worker 0's last step per layer."""
    p = plans[1] if case == "one" else plans[2]
    loaded = runner.results(
        spec, p, BATCH, STEPS, exchange_only=case == "exchange", split=case != "joined"
    )
    times = np.max([r.step_times for r, _, _ in loaded], axis=0)[WARMUP:]
    out = {"step_ms": float(np.median(times)) * 1e3}
    if case in ("split", "joined"):
        waits = [statistics.median(s["wait"] for s in prof[WARMUP:]) for _, prof, _ in loaded]
        out["exposed_ms"] = float(np.mean(waits)) * 1e3
        last = loaded[0][0]
        out["layers"] = {
            f"{layer}/{phase}": {
                "exposed_ms": last.exchange_s.get((layer, phase), 0.0) * 1e3,
                "hidden_ms": last.hidden_s.get((layer, phase), 0.0) * 1e3,
            }
            for layer, phase in sorted(set(last.exchange_s) | set(last.hidden_s))
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bench-local,bench-local-wide")
    ap.add_argument("--share", type=float, default=0.45, help="each machine's share of a core")
    ap.add_argument("--rate", default="100mbit", help="each machine's link (tc tbf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from netpart.testbed import cgroups, netns

    why = netns.unavailable() or cgroups.unavailable()
    if why is not None:
        print(f"overlap_bench: skipped: {why}")
        return 0
    results: dict = {"share": args.share, "rate": args.rate, "batch": BATCH, "models": {}}
    with (
        netns.switched_hosts(2, rate=args.rate, burst="1600") as hosts,
        cgroups.cpu_shares(2, args.share) as groups,
    ):
        runner = EmulatedRunner(hosts, groups, args.share)
        for name in args.models.split(","):
            spec = load_spec(name)
            plans = {n: plan(spec, n, "metis", batch=BATCH) for n in (1, 2)}
            runs: dict[str, list[dict]] = {c: [] for c in CASES}
            for r in range(args.rounds):
                for case in CASES:
                    runs[case].append(_case(runner, spec, plans, case))
                print(f"{name} round {r + 1}: " + ", ".join(
                    f"{c} {runs[c][-1]['step_ms']:.1f} ms" for c in CASES
                ), flush=True)  # fmt: skip
            results["models"][name] = _summary(name, runs)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


def _summary(name: str, runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds, printed; the rounds kept."""

    def med(case: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[case]))

    one, split, joined = med("one", "step_ms"), med("split", "step_ms"), med("joined", "step_ms")
    pairs = zip(runs["split"], runs["joined"], strict=True)
    hidden = [1 - s["exposed_ms"] / j["exposed_ms"] for s, j in pairs]
    out = {
        "one_ms": one, "split_ms": split, "joined_ms": joined,
        "exchange_ms": med("exchange", "step_ms"),
        "exposed_split_ms": med("split", "exposed_ms"),
        "exposed_joined_ms": med("joined", "exposed_ms"),
        "speedup": one / split, "speedup_joined": one / joined,
        "hidden_share": float(statistics.median(hidden)), "hidden_rounds": hidden,
        "layers_split": runs["split"][-1]["layers"], "rounds": runs,
    }  # fmt: skip
    print(
        f"{name}: N=1 {one:.1f} ms, N=2 split {split:.1f} ms (speedup {out['speedup']:.2f}x), "
        f"joined {joined:.1f} ms ({out['speedup_joined']:.2f}x), exchange alone "
        f"{out['exchange_ms']:.1f} ms; exposed {out['exposed_split_ms']:.1f} vs "
        f"{out['exposed_joined_ms']:.1f} ms: {out['hidden_share']:.0%} hidden "
        f"(rounds {', '.join(f'{h:.0%}' for h in hidden)})"
    )
    layers = out["layers_split"]
    print("  per layer (split, worker 0, last step; exposed/hidden ms): " + "; ".join(
        f"{k} {v['exposed_ms']:.0f}/{v['hidden_ms']:.0f}" for k, v in layers.items()
    ))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
