"""Runtime benchmark: what a partitioned step costs against its compute and its bytes.

Every figure is a ratio measured side by side in one run (A and B alternate; medians of the
pairs), one thread per process, batch 32, float32:

(a) overhead: one model worker (N=1, no peers) vs the plain reference module, fwd+bwd,
    alternated in one process: `digits-mlp` (64-256-256-10) and `bench-local` (10M);
(b) scaling: N=2 processes vs N=1 (step = slowest worker, median after warm-up), alternated
    runs: the MLP (N=2 / N=1 step ratio) and `bench-local`, `bench-local-wide` (speedup);
(c) efficiency at N=2: the measured step over (the slowest worker's isolated compute + the
    raw gloo time of the same messages): isolated compute from every slice run alone
    (`netpart.calibrate.trace`), messages from the same programs run without compute;
(d) overlap on bench-local-wide at N=2: exposed exchange with overlap over the exchange of
    the same program without it (alternated runs);
(e) the locally connected slice kernel's GFLOP/s vs a dense matmul's;
(--breakdown) where each step goes at N = 1, 2, 3 on the three models (`netpart.runtime.breakdown`).

    python benchmarks/runtime_bench.py --out benchmarks/results/runtime_bench.json
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from harness import parser, write_results

from netpart.calibrate.trace import measure_slices
from netpart.compile.schedule import plan_schedule
from netpart.models import build_reference, load_spec
from netpart.partition import plan
from netpart.runtime.breakdown import step_breakdown, thread_medians
from netpart.runtime.check import make_batch
from netpart.runtime.inprocess import ThreadTransport
from netpart.runtime.step import StepOptions, run_step
from netpart.runtime.worker import ModelWorker
from netpart.timing import alternate, each_call

MODELS = ("digits-mlp", "bench-local", "bench-local-wide")
WARMUP = 5
STEPS = {"digits-mlp": 300, "bench-local": 20, "bench-local-wide": 12}  # timed steps a run


def overhead(name: str, batch: int, repeat: int) -> dict:
    """(a) N=1 worker step vs reference fwd+bwd, alternated, one thread."""
    torch.set_num_threads(1)
    spec = load_spec(name)
    x, y = make_batch(spec, batch, 0)
    x = x.float()
    model = build_reference(spec, 0, torch.float32)
    worker = ModelWorker(spec, *plan_schedule(spec, plan(spec, 1)), 0, seed=0, dtype=torch.float32)
    transport = ThreadTransport.group(1)[0]  # never used: one worker sends nothing

    def ref_step():
        model.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()

    def worker_step():  # the same work: loss and gradients (no accuracy metric)
        worker.zero_grad()
        worker.step(x, y, transport, collect_grads=False, accuracy=False)

    runs = alternate({"worker": worker_step, "reference": ref_step}, rounds=repeat, warm=3)
    return {
        "worker_step_s": runs.median("worker"),
        "reference_step_s": runs.median("reference"),
        "ratio_median": statistics.median(runs.round_ratios("worker", "reference")),
    }


def _run(spec, workers: int, batch: int, steps: int, **kw):
    steps = max(steps, STEPS.get(spec.name, steps))  # a tiny model needs many steps to settle
    x, y = make_batch(spec, batch, 0)
    options = StepOptions(dtype="float32", steps=steps + WARMUP + 1, threads=1, **kw)
    return run_step(spec, plan(spec, workers), x.float(), y, options)


def _step_s(result) -> float:
    """Median over timed steps of the slowest worker (warm-up and the gradient-collecting
    last step dropped)."""
    return float(np.median(result.slowest_steps()[WARMUP:-1]))


def scaling(name: str, batch: int, steps: int, pairs: int) -> dict:
    """(b) N=1 and N=2 runs alternate `pairs` times; medians of the per-pair ratios."""
    spec = load_spec(name)
    runs = alternate(
        {
            "n1": lambda: _step_s(_run(spec, 1, batch, steps)),
            "n2": lambda: _step_s(_run(spec, 2, batch, steps)),
        },
        rounds=pairs,
        warm=0,
    )
    ratios = runs.round_ratios("n1", "n2")
    return {
        "n1_step_s": runs.median("n1"),
        "n2_step_s": runs.median("n2"),
        "speedup": statistics.median(ratios),
        "n2_over_n1": statistics.median(1 / r for r in ratios),
        "speedup_per_pair": ratios,
    }


def efficiency(name: str, batch: int, steps: int, pairs: int) -> dict:
    """(c) measured N=2 step / (slowest isolated compute + raw messages), alternated."""
    spec = load_spec(name)
    p = plan(spec, 2)
    runs = alternate(
        {
            "measured": lambda: _step_s(_run(spec, 2, batch, steps)),
            "raw": lambda: _step_s(_run(spec, 2, batch, steps, exchange_only=True)),
        },
        rounds=pairs,
        warm=0,
    )
    times = measure_slices(spec, p, batch)
    compute = float((times.forward + times.backward).sum(axis=0).max())
    measured, raw = runs.seconds["measured"], runs.seconds["raw"]
    ratios = [m / (compute + r) for m, r in zip(measured, raw, strict=True)]
    return {
        "measured_step_s": runs.median("measured"),
        "isolated_compute_s": compute,
        "raw_messages_s": runs.median("raw"),
        "efficiency": statistics.median(ratios),
        "per_pair": ratios,
    }


def _exposed(result) -> float:
    """The slowest worker's exposed halo exchange (posting + waiting), last step."""
    return max(sum(v for (_, phase), v in e.items() if phase != "loss") for e in result.exchange_s)


def overlap(name: str, batch: int, steps: int, pairs: int) -> dict:
    """(d) exposed exchange with overlap / exchange without it, alternated."""
    spec = load_spec(name)
    runs = alternate(
        {
            "with": lambda: float(_exposed(_run(spec, 2, batch, steps, split=True))),
            "without": lambda: float(_exposed(_run(spec, 2, batch, steps, overlap=False))),
        },
        rounds=pairs,
        warm=0,
    )
    ratios = runs.round_ratios("with", "without")
    return {
        "exposed_with_overlap_s": runs.median("with"),
        "exchange_without_overlap_s": runs.median("without"),
        "exposed_share": statistics.median(ratios),
        "hidden_share": 1 - statistics.median(ratios),
        "per_pair": ratios,
    }


def breakdown(batch: int, steps: int) -> dict:
    """Median per-step breakdown of each worker at N = 1, 2, 3 on every model."""
    out = {}
    for name in MODELS:
        spec = load_spec(name)
        for n in (1, 2, 3):
            r = _run(spec, n, batch, steps)
            out[f"{name}/N={n}"] = [
                {
                    **step_breakdown(t[WARMUP:-1], p[WARMUP:-1]),
                    **thread_medians(th[WARMUP:-1]),
                }
                for t, p, th in zip(r.step_times, r.breakdowns, r.threads, strict=True)
            ]
    return out


def kernel_rate(batch: int, repeat: int) -> dict:
    """(e) the local slice (whole layer 3 of bench-local) vs a dense matmul, GFLOP/s, 1 thread."""
    torch.set_num_threads(1)
    spec = load_spec("bench-local")
    worker = ModelWorker(spec, *plan_schedule(spec, plan(spec, 1)), 0, seed=0, dtype=torch.float32)
    layer = 3
    sl = worker.slices[layer]
    src = spec.input_shape(layer)
    x = torch.randn(src.size + 2, batch)  # units-major, as the runtime holds it
    flops = 2.0 * spec.layer_params(layer) * batch  # multiply-adds of every weight, per example
    with torch.no_grad():
        sl(x)
        local_t = statistics.median(r.seconds for r in each_call(lambda: sl(x), repeat))
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    mm_t = statistics.median(r.seconds for r in each_call(lambda: torch.mm(a, b), repeat))
    mm_rate = 2.0 * n**3 / mm_t / 1e9
    local_rate = flops / local_t / 1e9
    return {
        "local_slice_gflops": local_rate,
        "dense_matmul_gflops": mm_rate,
        "ratio_local_over_matmul": local_rate / mm_rate,
    }


def _report(result: dict) -> None:
    for name, a in result.get("overhead", {}).items():
        target = "<= 1.2" if name == "digits-mlp" else "<= 0.6"
        ms = f"{a['worker_step_s'] * 1e3:.2f} ms vs reference {a['reference_step_s'] * 1e3:.2f} ms"
        print(f"(a) {name}: N=1 worker {ms}: {a['ratio_median']:.2f}x ({target})")
    for name, b in result.get("scaling", {}).items():
        pairs = ", ".join(f"{v:.2f}" for v in b["speedup_per_pair"])
        if name == "digits-mlp":
            what = f"N=2/N=1 {b['n2_over_n1']:.2f}x (<= 2.0)"
        else:
            what = f"speedup {b['speedup']:.2f}x (>= {1.6 if name == 'bench-local' else 1.85})"
        ms = f"N=1 {b['n1_step_s'] * 1e3:.1f} ms, N=2 {b['n2_step_s'] * 1e3:.1f} ms"
        print(f"(b) {name}: {ms}: {what}; speedup per pair {pairs}")
    for name, c in result.get("efficiency", {}).items():
        parts = (
            f"isolated compute {c['isolated_compute_s'] * 1e3:.1f} + raw messages "
            f"{c['raw_messages_s'] * 1e3:.1f} ms"
        )
        step = c["measured_step_s"] * 1e3
        print(f"(c) {name}: N=2 step {step:.1f} ms over {parts}: {c['efficiency']:.3f} (<= 1.25)")
    d = result.get("overlap")
    if d:
        ms = (
            f"{d['exposed_with_overlap_s'] * 1e3:.1f} ms with overlap, "
            f"{d['exchange_without_overlap_s'] * 1e3:.1f} ms without"
        )
        print(f"(d) bench-local-wide N=2 exposed exchange: {ms}: {d['hidden_share']:.0%} hidden")
    e = result.get("kernel")
    if e:
        rates = (
            f"{e['local_slice_gflops']:.1f} GFLOP/s vs dense matmul {e['dense_matmul_gflops']:.1f}"
        )
        print(f"(e) local slice {rates}: {e['ratio_local_over_matmul']:.2f} (>= 0.3)")
    for key, workers in result.get("breakdown", {}).items():
        for w, prof in enumerate(workers):
            parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in prof.items())
            print(f"breakdown {key} worker {w} (ms/step): {parts}")


def main() -> int:
    ap = parser("runtime_bench", __doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=41, help="alternations for (a), (e)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per run (at least)")
    ap.add_argument("--pairs", type=int, default=5, help="alternating run pairs for (b)-(d)")
    ap.add_argument("--breakdown", action="store_true", help="also break down N = 1, 2, 3")
    ap.add_argument("--only", choices=("a", "b", "c", "d", "e"), default=None)
    args = ap.parse_args()
    run = {k: args.only in (None, k) for k in "abcde"}
    b, steps, pairs = args.batch, args.steps, args.pairs
    result = {
        "batch": b,
        "overhead": {m: overhead(m, b, args.repeat) for m in MODELS[:2]} if run["a"] else {},
        "scaling": {m: scaling(m, b, steps, pairs) for m in MODELS} if run["b"] else {},
        "efficiency": {m: efficiency(m, b, steps, pairs) for m in MODELS[1:]} if run["c"] else {},
        "overlap": overlap("bench-local-wide", b, steps, pairs) if run["d"] else {},
        "kernel": kernel_rate(b, args.repeat) if run["e"] else {},
    }
    if args.breakdown:
        result["breakdown"] = breakdown(args.batch, args.steps)
    _report({k: v for k, v in result.items() if v or k == "breakdown"})
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
