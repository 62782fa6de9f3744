"""Model parallelism on emulated dedicated machines: the N-worker step against the 1-worker
step, split against joined against the planner's choice, the exchange against its wire time.

Each worker has a machine of its own: a network namespace behind a shaped link (`tc tbf`,
its bucket `netns.burst_for(rate)`) and either a cpu cgroup held to `--share` of a core
(`quota`) or a whole core of its own by cpuset (`cores`; this machine has two, so N <= 2).
Per rate, emulation and model, rounds alternating the cases:

- `one`: the 1-worker step (one machine); from it the machine's rate (FLOP/s), with which
  and the link's bandwidth the N-worker plan is made, so the planner's choice of which layers
  to split (`netpart.cost.overlap`) is made for this machine;
- per N: `auto` (the plan's choice), `split` (every layer that qualifies split: interior
  units while the forward halo travels, weight gradients while the backward halo does,
  producer chains), `joined` (no layer split: halo exchanged, then computed), `exchange`
  (the plan's messages alone).

Figures (medians over rounds): speedup = one / case; the exchange alone against the wire
time of the plan's bytes (busiest worker, per phase the larger of what it sends and
receives, at the link's rate); the transport's CPU per byte moved (gloo's threads in the
joined step); the share of the exchange a split hides (1 - exposed split / exposed joined);
and `split_cost`, what splitting added to the work (the split step less the joined one,
plus the exchange it hid) per second of the work the plan can hide behind
(`overlap.hiding`). Each round runs the cases in an order rotated by a third (so a position's
effect falls on every case alike). Needs root.

    python benchmarks/overlap_bench.py --out benchmarks/results/overlap_bench.json  # ~25 min
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from harness import parser, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from netpart.calibrate.emulated import WARMUP, EmulatedRunner  # noqa: E402
from netpart.cost.machine import Machine  # noqa: E402
from netpart.models import load_spec  # noqa: E402
from netpart.partition import plan  # noqa: E402
from netpart.testbed import cgroups, netns  # noqa: E402
from netpart.testbed.bed import unavailable  # noqa: E402

BATCH, STEPS = 32, 10
CASES = ("auto", "split", "joined", "exchange")


def _median_of(usage: list[dict], key: str) -> float:
    return float(statistics.median(u.get(key, 0.0) for u in usage[WARMUP:]))


def _case(runner: EmulatedRunner, spec, p, case: str) -> dict:
    """One run of one case: its median step (slowest worker); with several workers, the
    median blocked on halo (`wait`, mean over workers) and CPU per step of the main thread
    and of gloo's threads (mean over workers)."""
    loaded = runner.results(
        spec, p, BATCH, STEPS, exchange_only=case == "exchange", split=case != "joined"
    )
    times = np.max([r.step_times for r, _, _ in loaded], axis=0)[WARMUP:]
    out = {"step_ms": float(np.median(times)) * 1e3}
    if case in ("auto", "split", "joined") and p.workers > 1:
        waits = [statistics.median(s["wait"] for s in prof[WARMUP:]) for _, prof, _ in loaded]
        out["exposed_ms"] = float(np.mean(waits)) * 1e3
        out["main_cpu_ms"] = 1e3 * float(np.mean([_median_of(u, "main_cpu_s") for *_, u in loaded]))
        gloo = [
            sum(_median_of(u, k) for k in u[-1] if k.startswith("gloo") and k.endswith("cpu_s"))
            for *_, u in loaded
        ]
        out["gloo_cpu_ms"] = 1e3 * float(np.mean(gloo))
    return out


def _wire_ms(p, rate_bps: float) -> float:
    """The plan's bytes per step on the busiest worker's link at `rate_bps`: per phase
    (forward values, backward gradients) the larger of what it sends and receives."""
    busiest = max(max(w.halo_in_bytes, w.halo_out_bytes) for w in p.per_worker)
    return 2 * busiest * BATCH * 8 / rate_bps * 1e3


def _variants(spec, single, n: int, rate: float, one_s: float) -> dict:
    """The N-worker plan made for this machine (its rate from the 1-worker plan `single`'s
    step, `one_s`), and the same node map with every layer split and with none."""
    flops = sum(sum(w.flops) for w in single.per_worker)
    net = Machine(bandwidth_bps=rate, flops_per_s=flops * BATCH / one_s)
    auto = plan(spec, n, "metis", batch=BATCH, network=net)
    every = replace(auto, layers=tuple(replace(layer, split=True) for layer in auto.layers))
    return {"auto": auto, "split": every, "joined": auto, "exchange": auto}


def _machines(stack, n: int, rate: str, cpu: str, share: float) -> EmulatedRunner:
    hosts = stack.enter_context(netns.switched_hosts(n, rate=rate))
    quota = cpu == "quota"
    groups = stack.enter_context(cgroups.cpu_shares(n, share) if quota else cgroups.whole_cores(n))
    return EmulatedRunner(hosts, groups, share if quota else 1.0)


def _bench(spec, rate: str, cpu: str, counts: list[int], args) -> dict:
    """Every case of one model on one link and emulation, `args.rounds` rounds."""
    runs: dict[str, list[dict]] = {"one": []}
    single = plan(spec, 1, "metis", batch=BATCH)
    order = [("one", 1), *((case, n) for n in counts for case in CASES)]
    with contextlib.ExitStack() as stack:
        runner = _machines(stack, max(counts), rate, cpu, args.share)
        one_s = _case(runner, spec, single, "one")["step_ms"] / 1e3  # the machine's rate
        plans = {n: _variants(spec, single, n, netns.rate_bps(rate), one_s) for n in counts}
        for r in range(args.rounds):
            shift = r * len(order) // args.rounds  # each round starts elsewhere in the order
            for case, n in order[shift:] + order[:shift]:
                p = single if case == "one" else plans[n][case]
                key = "one" if case == "one" else f"{case}{n}"
                runs.setdefault(key, []).append(_case(runner, spec, p, case))
            last = ", ".join(f"{k} {v[-1]['step_ms']:.1f}" for k, v in runs.items())
            print(f"  round {r + 1}: {last}", flush=True)
    return _summary(runs, plans, netns.rate_bps(rate))


def _summary(runs: dict[str, list[dict]], plans: dict, rate_bps: float) -> dict:
    """Medians over rounds per number of workers, printed; the rounds kept."""

    def med(key: str, field: str = "step_ms") -> float:
        return float(statistics.median(r[field] for r in runs[key]))

    one = med("one")
    out: dict = {"one_ms": one, "workers": {}, "rounds": runs}
    for n, variants in plans.items():
        p = variants["auto"]
        steps = {case: med(f"{case}{n}") for case in CASES}
        moved = np.mean([2 * (w.halo_in_bytes + w.halo_out_bytes) * BATCH for w in p.per_worker])
        hideable = sum(layer.hideable_s for layer in p.layers) * 1e3
        # what splitting added: the step's growth plus the exchange it hid
        hid = med(f"joined{n}", "exposed_ms") - med(f"split{n}", "exposed_ms")
        extra = steps["split"] - steps["joined"] + hid
        best = min(steps["split"], steps["joined"])
        fig = {
            **{f"{case}_ms": steps[case] for case in CASES},
            **{f"speedup_{case}": one / steps[case] for case in ("auto", "split", "joined")},
            "auto_over_best": steps["auto"] / best,
            "split_layers": [layer.name for layer in p.layers if layer.split],
            "wire_ms": _wire_ms(p, rate_bps),
            "exchange_over_wire": steps["exchange"] / _wire_ms(p, rate_bps),
            "gloo_cpu_ms_per_mb": med(f"joined{n}", "gloo_cpu_ms") / (moved / 1e6),
            "exposed_split_ms": med(f"split{n}", "exposed_ms"),
            "exposed_joined_ms": med(f"joined{n}", "exposed_ms"),
            "hidden_share": 1 - med(f"split{n}", "exposed_ms") / med(f"joined{n}", "exposed_ms"),
            "split_extra_ms": extra,
            "hideable_ms": hideable,
            "split_cost": extra / hideable if hideable > 0 else None,
        }
        out["workers"][str(n)] = fig
        print(
            f"  N={n}: one {one:.1f} ms; auto {steps['auto']:.1f} ({fig['speedup_auto']:.2f}x, "
            f"splits {fig['split_layers'] or 'none'}), split {steps['split']:.1f} "
            f"({fig['speedup_split']:.2f}x), joined {steps['joined']:.1f} "
            f"({fig['speedup_joined']:.2f}x); auto / best {fig['auto_over_best']:.3f}; exchange "
            f"{steps['exchange']:.1f} ms = {fig['exchange_over_wire']:.2f}x wire "
            f"{fig['wire_ms']:.1f} ms; gloo {fig['gloo_cpu_ms_per_mb']:.2f} ms CPU/MB; hidden "
            f"{fig['hidden_share']:.0%}; split cost {extra:.1f} ms = "
            f"{fig['split_cost'] or 0:.2f} of {hideable:.1f} ms hideable",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    ap = parser("overlap_bench", __doc__)
    ap.set_defaults(rounds=3)
    ap.add_argument("--models", default="bench-local,bench-local-wide")
    ap.add_argument("--share", type=float, default=0.45, help="a quota machine's share of a core")
    ap.add_argument("--rates", default="1gbit,100mbit", help="each machine's link (tc units)")
    ap.add_argument("--cpus", default="quota,cores", help="emulations: quota and/or cores")
    ap.add_argument("--workers", default="2,4", help="model workers to compare with one")
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"overlap_bench: skipped: {why}")
        return 0
    cores = len(os.sched_getaffinity(0))
    results: dict = {"share": args.share, "batch": BATCH, "steps": STEPS, "runs": {}}
    for rate in args.rates.split(","):
        for cpu in args.cpus.split(","):
            counts = [int(n) for n in args.workers.split(",")]
            if cpu == "cores":  # a core each: no more machines than cores
                counts = [n for n in counts if n <= cores]
            for name in args.models.split(","):
                print(f"{name}, {rate}, {cpu}:", flush=True)
                spec = load_spec(name)
                results["runs"][f"{name}/{rate}/{cpu}"] = _bench(spec, rate, cpu, counts, args)
    write_results(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
