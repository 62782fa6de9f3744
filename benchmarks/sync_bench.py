"""Sync aggregation against an all-reduce of the same bytes, side by side in one run.

R replicas exchange digits-mlp's gradients (85,002 float32 values, 340 KB) and nothing else
(no compute), `--iters` times per run, one thread per process, on this machine's loopback:

- `netpart`: R `ShardClient`s push-and-fetch to one `ShardServer` in sync mode (headers,
  checks, the per-replica sums, the mean and SGD applied once, a reply per replica):
  R + 1 processes;
- `allreduce`: `torch.distributed.all_reduce` of the same tensor among the R processes (gloo;
  what DDP does with this model's one 340 KB bucket): R processes;
- `raw`: netpart's traffic with bare gloo calls: a server receives every push, sums them and
  sends the sum back (the floor under netpart's path): R + 1 processes.

With `--baseline DIR` (a checkout of another commit, e.g. a `git worktree`), `baseline` runs
the netpart role with that checkout's `netpart` package, beside the others.

Rounds alternate the systems. Figures: per run the median of the replicas' ms per exchange;
per system the median over rounds; and the per-round ratios allreduce / netpart (>= 1: the
shard's path is at least as fast as an all-reduce of the same bytes) and netpart / raw.

    python benchmarks/sync_bench.py --out benchmarks/results/sync_bench.json   # ~4 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0  # seconds for one run

ROLE = r"""
import json, os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
system, rank, world, store, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
replicas = world if system == "allreduce" else world - 1
n = 85002  # digits-mlp's values
clock = time.perf_counter
if system == "netpart":
    from netpart.models import load_spec
    from netpart.partition import build_unit_graph, plan
    from netpart.compile.shards import ShardLayout
    from netpart.ps import Optimizer, ShardClient, ShardServer, ShardSetup, ShardState, Sync
    from netpart.ps import make_rule
    spec = load_spec("digits-mlp")
    p = plan(spec, 1, "metis")
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 1, 1)
    assert layout.worker_size(0) == n
    if rank == replicas:
        values = torch.zeros(n)
        setup = ShardSetup(layout, 0, replicas, rank, lambda r, w: r)
        rule = make_rule(Optimizer("sgd", 0.01), values)
        ShardServer(setup, ShardState(values=values, state=None), Sync(), rule).serve()
        os._exit(0)
    client = ShardClient(layout, worker=0, replica=rank, rank=rank, shard_ranks=[replicas],
                         dtype=torch.float32)
    grads = client.push_buffers(1)[0]
    grads.normal_()
    client.complete(client.request(0, fetch=True))
    exchange = lambda step: client.complete(client.request(step, grads, fetch=True))
elif system == "allreduce":
    x = torch.randn(n)
    exchange = lambda step: dist.all_reduce(x)
    exchange(0)  # as the others: one untimed exchange first
else:  # raw: the server sums every push and answers each replica with the sum
    if rank == replicas:
        bufs = [torch.empty(n) for _ in range(replicas)]
        total = torch.empty(n)
        for _ in range(iters + 1):
            for w in [dist.irecv(b, src=r) for r, b in enumerate(bufs)]:
                w.wait()
            torch.sum(torch.stack(bufs), 0, out=total)
            for w in [dist.isend(total, dst=r) for r in range(replicas)]:
                w.wait()
        os._exit(0)
    x, y = torch.randn(n), torch.empty(n)
    def exchange(step):
        got = dist.irecv(y, src=replicas)
        dist.send(x, dst=replicas)
        got.wait()
    exchange(0)
t0 = clock()
for step in range(1, iters + 1):
    exchange(step)
seconds = clock() - t0
print(json.dumps({"rank": rank, "ms": seconds / iters * 1e3}))
sys.stdout.flush()
if system == "netpart":
    client.close()
os._exit(0)  # the shard's peer threads may still sit in gloo calls
"""

SYSTEMS = ("netpart", "allreduce", "raw")


def run(system: str, replicas: int, iters: int, tmp: Path, baseline: Path | None) -> float:
    """Median over the replicas of ms per exchange (nan if a process failed or timed out)."""
    world = replicas if system == "allreduce" else replicas + 1
    store = tmp / f"store{time.monotonic_ns()}"
    env, cwd = dict(os.environ), ROOT  # `python -c` imports from its working directory first
    if system == "baseline":  # the netpart role, importing the other checkout's package
        env["PYTHONPATH"], cwd = str(baseline), baseline
        system = "netpart"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ROLE, system, str(rank), str(world), str(store), str(iters)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for rank in range(world)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        return float("nan")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        return float("nan")
    ms = [json.loads(line)["ms"] for out in outs for line in out.splitlines() if line]
    return statistics.median(ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="2,4", help="replica counts (default 2,4)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    ap.add_argument("--iters", type=int, default=1000, help="exchanges per run (default 1000)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 1:
        ap.error("--rounds and --iters must be at least 1")
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "netpart" / "ps").is_dir():
            ap.error(f"--baseline {args.baseline}: no netpart/ps package there")
    systems = SYSTEMS + (("baseline",) if args.baseline is not None else ())
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="sync-bench-") as tmp:
        for rnd in range(args.rounds):
            for replicas in (int(r) for r in args.replicas.split(",")):
                for system in systems:
                    ms = run(system, replicas, args.iters, Path(tmp), args.baseline)
                    results.setdefault(f"R={replicas}", {}).setdefault(system, []).append(ms)
                    print(f"round {rnd + 1} R={replicas} {system}: {ms:.3f} ms", flush=True)
    summary = {}
    for key, runs in results.items():
        vs_allreduce = [a / n for a, n in zip(runs["allreduce"], runs["netpart"], strict=True)]
        over_raw = [n / r for n, r in zip(runs["netpart"], runs["raw"], strict=True)]
        summary[key] = {
            "ms": runs,
            "ms_median": {s: statistics.median(v) for s, v in runs.items()},
            "allreduce_over_netpart": vs_allreduce,
            "allreduce_over_netpart_median": statistics.median(vs_allreduce),
            "netpart_over_raw_median": statistics.median(over_raw),
        }
        if "baseline" in runs:
            pairs = zip(runs["baseline"], runs["netpart"], strict=True)
            summary[key]["baseline_over_netpart_median"] = statistics.median(
                b / n for b, n in pairs
            )
        med = summary[key]["ms_median"]
        print(
            f"{key}: netpart {med['netpart']:.3f} ms, all-reduce {med['allreduce']:.3f} ms, "
            f"raw {med['raw']:.3f} ms; all-reduce / netpart "
            f"{summary[key]['allreduce_over_netpart_median']:.2f}x (per round "
            + ", ".join(f"{v:.2f}" for v in vs_allreduce)
            + ")"
            + (f"; baseline {med['baseline']:.3f} ms" if "baseline" in med else "")
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        job = {
            "values": 85002,
            "dtype": "float32",
            "iters": args.iters,
            "rounds": args.rounds,
            "baseline": None if args.baseline is None else str(args.baseline),
        }
        args.out.write_text(json.dumps({"job": job, "results": summary}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
