"""A shard's update cost per value: netpart's Adagrad and SGD rules (`netpart.ps.rules`) on one
thread, over vectors of 1M-16M values, the median of --repeats timed applications each. The
cluster planner (`netpart.planning.cluster.UPDATE_S_PER_VALUE`) prices a shard's updates at
the Adagrad figure.

    python benchmarks/update_bench.py --out benchmarks/results/update_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from netpart.files import write_atomic
from netpart.ps.rules import Adagrad, Sgd


def per_value(rule_name: str, n: int, repeats: int) -> float:
    values = torch.zeros(n)
    rule = Adagrad(0.01, 1e-10, values) if rule_name == "adagrad" else Sgd(0.05, values)
    grad = torch.randn(n)
    rule.apply(0, grad)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rule.apply(0, grad)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for rule in ("adagrad", "sgd"):
        for n in (1 << 20, 1 << 22, 1 << 24):
            s = per_value(rule, n, args.repeats)
            rows.append({"rule": rule, "values": n, "s_per_value": s})
            print(f"{rule:<8} {n:>10,} values: {s * 1e9:.3f} ns a value")
    if args.out is not None:
        write_atomic(args.out, json.dumps({"threads": 1, "rows": rows}, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
