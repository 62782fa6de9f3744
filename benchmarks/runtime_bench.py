"""Runtime benchmark: overhead, speedup and local-kernel rate, each as a side-by-side ratio.

(a) one model worker (N=1, no peers) vs the plain reference module, fwd+bwd, same thread
    count, alternated in one process; (b) two mid-size locally connected models at N=2 worker
    processes (one thread each) vs N=1 (one thread), step time = slowest worker per step:
    `bench-local` (10M parameters) and `bench-local-wide` (the same layers with twice the
    channels, 32M parameters);
(c) the locally connected slice kernel's GFLOP/s vs a dense matmul's, one thread.

    python benchmarks/runtime_bench.py --out benchmarks/results/runtime_bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from netpart.models import ModelSpec, build_reference
from netpart.partition import plan
from netpart.partition.schedule import plan_schedule
from netpart.runtime import run_step
from netpart.runtime.check import make_batch
from netpart.runtime.inprocess import ThreadTransport
from netpart.runtime.worker import ModelWorker

MID_LOCAL = ModelSpec.from_dict(
    {
        "name": "bench-local",
        "input": {"channels": 3, "height": 48, "width": 48},
        "layer": [
            {"kind": "local", "channels": 24, "kernel": 5},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "lcn", "kernel": 5},
            {"kind": "local", "channels": 32, "kernel": 5},
            {"kind": "pool", "mode": "max", "kernel": 2},
            {"kind": "dense", "units": 10, "activation": "softmax"},
        ],
    }
)


WIDE_LOCAL = ModelSpec.from_dict(
    {
        **MID_LOCAL.to_dict(),
        "name": "bench-local-wide",
        "layer": [
            {**layer, "channels": 2 * layer["channels"]} if "channels" in layer else layer
            for layer in MID_LOCAL.to_dict()["layer"]
        ],
    }
)


def _timeit(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def overhead(batch: int, repeat: int) -> dict:
    """(a) N=1 worker step vs reference fwd+bwd, alternated, one thread."""
    torch.set_num_threads(1)
    spec = MID_LOCAL
    x, y = make_batch(spec, batch, 0)
    x = x.float()
    model = build_reference(spec, 0, torch.float32)
    p = plan(spec, 1)
    worker = ModelWorker(spec, *plan_schedule(spec, p), 0, 0, torch.float32)
    transport = ThreadTransport.group(1)[0]

    def ref_step():
        model.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()

    def worker_step():
        worker.zero_grad()
        worker.step(x, y, transport, collect_grads=False)

    ref_step(), worker_step()  # warm-up
    ratios, ref_t, work_t = [], [], []
    for _ in range(repeat):
        (a,) = _timeit(worker_step, 1)
        (b,) = _timeit(ref_step, 1)
        ratios.append(a / b)
        work_t.append(a)
        ref_t.append(b)
    return {
        "worker_step_s": statistics.median(work_t),
        "reference_step_s": statistics.median(ref_t),
        "ratio_median": statistics.median(ratios),
    }


def speedup(spec: ModelSpec, batch: int, steps: int, methods: list[str], pairs: int) -> dict:
    """(b) N=2 processes (1 thread each) vs N=1 (1 thread), same batch, lockstep step time.

    N=1 and N=2 runs alternate `pairs` times; the figure is the median of the per-pair ratios
    (the machine's speed drifts between runs by more than the effect measured).
    """
    x, y = make_batch(spec, batch, 0)
    x = x.float()

    def step_time(workers: int, method: str) -> float:
        r = run_step(
            spec, plan(spec, workers, method), x, y, dtype=torch.float32, steps=steps, threads=1
        )
        # Slowest worker per step; drop 5 warm-up steps and the last (it collects gradients).
        per_step = np.max(np.array(r.step_times), axis=0)[5:-1]
        return float(np.median(per_step))

    out = {}
    for method in methods:
        ones, twos = [], []
        for _ in range(pairs):
            ones.append(step_time(1, method))
            twos.append(step_time(2, method))
        ratios = [a / b for a, b in zip(ones, twos, strict=True)]
        out[method] = {
            "n1_step_s": statistics.median(ones),
            "n2_step_s": statistics.median(twos),
            "speedup": statistics.median(ratios),
            "speedup_per_pair": ratios,
        }
    return out


def kernel_rate(batch: int, repeat: int) -> dict:
    """(c) the local slice (whole layer 3 of bench-local) vs a dense matmul, GFLOP/s, 1 thread."""
    torch.set_num_threads(1)
    spec = MID_LOCAL
    p = plan(spec, 1)
    worker = ModelWorker(spec, *plan_schedule(spec, p), 0, 0, torch.float32)
    layer = 3
    sl = worker.slices[layer]
    src = spec.input_shape(layer)
    x = torch.randn(src.size + 2, batch)  # units-major, as the runtime holds it
    flops = 2.0 * spec.layer_params(layer) * batch  # multiply-adds of every weight, per example
    with torch.no_grad():
        sl(x)
        local_t = statistics.median(_timeit(lambda: sl(x), repeat))
    ref = build_reference(spec, 0, torch.float32).layers[layer]
    xr = torch.randn(batch, src.channels, src.height, src.width)
    with torch.no_grad():
        ref(xr)
        ref_t = statistics.median(_timeit(lambda: ref(xr), repeat))
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    mm_t = statistics.median(_timeit(lambda: torch.mm(a, b), repeat))
    mm_rate = 2.0 * n**3 / mm_t / 1e9
    local_rate = flops / local_t / 1e9
    return {
        "local_slice_gflops": local_rate,
        "reference_unfold_bmm_gflops": flops / ref_t / 1e9,
        "dense_matmul_gflops": mm_rate,
        "ratio_local_over_matmul": local_rate / mm_rate,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=5, help="alternating N=1 / N=2 runs for (b)")
    args = ap.parse_args()
    a = overhead(args.batch, args.repeat)
    print(
        f"(a) N=1 worker {a['worker_step_s'] * 1e3:.1f} ms vs reference "
        f"{a['reference_step_s'] * 1e3:.1f} ms per step: ratio {a['ratio_median']:.3f} "
        "(target <= 1.15)"
    )
    b = {
        spec.name: speedup(spec, args.batch, args.steps, ["metis", "tiles"], args.pairs)
        for spec in (MID_LOCAL, WIDE_LOCAL)
    }
    for name, method, r in ((n, m, r) for n, d in b.items() for m, r in d.items()):
        print(
            f"(b) {name}, {method}: N=1 {r['n1_step_s'] * 1e3:.1f} ms, "
            f"N=2 {r['n2_step_s'] * 1e3:.1f} ms: "
            f"speedup {r['speedup']:.2f}x, median of "
            f"{', '.join(f'{v:.2f}' for v in r['speedup_per_pair'])} (target >= 1.6)"
        )
    c = kernel_rate(args.batch, args.repeat)
    print(
        f"(c) local slice {c['local_slice_gflops']:.1f} GFLOP/s, reference unfold+bmm "
        f"{c['reference_unfold_bmm_gflops']:.1f}, dense matmul {c['dense_matmul_gflops']:.1f}: "
        f"ratio {c['ratio_local_over_matmul']:.2f} (target >= 0.3)"
    )
    result = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "batch": args.batch,
        "overhead": a,
        "speedup": b,
        "kernel": c,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
