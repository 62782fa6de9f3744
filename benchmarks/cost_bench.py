"""Cost per sample: CPU-seconds of all a job's processes per training sample, a measure that
contention on this shared machine does not move (issue 47).

The job is dp_bench's (the digits MLP, batch 32 per replica, SGD lr 0.05, n_push = n_fetch =
1, one thread per process). Each system runs twice, for SHORT and LONG steps per replica;
the CPU it used is what its processes' whole tree used (this script's RUSAGE_CHILDREN before
and after: every process of the job is reaped by its parent, so a launcher's children's
children count too). Start-up, planning, the held-out evaluation and the report cost the
same at both lengths, so the marginal cost

    (CPU(LONG) - CPU(SHORT)) / (samples(LONG) - samples(SHORT))

is the cost of training a sample. Systems alternate within each round (A B A B ...), and
the figures are medians over rounds:

- `plain` (R=1): one plain torch process;
- `netpart-downpour` (R=1): `netpart train --workers 1 --replicas 1 --ps-shards 1`;
- `ddp` (R=2): DistributedDataParallel over gloo, 2 processes;
- `netpart-sync` (R=2) and `netpart-downpour` (R=2), one shard.

Targets (issue 47): netpart Downpour R=1 <= 1.3x plain; netpart sync R=2 <= DDP R=2.

Beside them, what the bytes alone cost, by the same method (`FLOOR`: processes that do
nothing but move the job's bytes over gloo a step, the MLP's 85,002 float32 gradients and
values, 340,008 bytes, with the headers the parameter server sends):

- `bytes-push` (R=1): a worker's push to one shard, answered by a header (Downpour R=1 with
  SGD: the shard's answer to a fetch is CURRENT, no values, when nothing but this worker's
  pushes changed them);
- `bytes-sync` (R=2): two workers each push to one shard and fetch from it (sync);
- `bytes-ring` (R=2): two processes all-reduce the gradients (DDP's ring).

The first against the budget 1.3x plain leaves beside plain's step, the second less the
third against the gap between DDP R=2 and netpart sync R=2: what no implementation of a
parameter server that moves these bytes over gloo can go below.

    python benchmarks/cost_bench.py --out benchmarks/results/cost_bench.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_bench import BATCH, DDP, LR, PLAIN, prepare_data

SHORT, LONG = 200, 1200  # steps per replica
SYSTEMS = (
    ("plain", 1),
    ("netpart-downpour", 1),
    ("ddp", 2),
    ("netpart-sync", 2),
    ("netpart-downpour", 2),
    ("bytes-push", 1),
    ("bytes-sync", 2),
    ("bytes-ring", 2),
)
VALUES = 85_002  # the MLP's parameters: its gradients, and its values fetched
FLOOR = r"""
import sys, torch, torch.distributed as dist
kind, store = sys.argv[1], sys.argv[5]
steps, rank, world = map(int, sys.argv[2:5])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
values, header = torch.randn(int(sys.argv[6])), torch.zeros(7, dtype=torch.int64)
shard = world - 1  # the last rank, where there is one
for _ in range(steps):
    if kind == "ring":
        dist.all_reduce(values)
    elif rank != shard:  # a worker: its push (header and values), then the answer
        dist.send(header, shard); dist.send(values, shard)
        dist.recv(header, shard)
        if kind == "sync":
            dist.recv(values, shard)
    else:  # the shard: every worker's push, then every answer
        for w in range(world - 1):
            dist.recv(header, w); dist.recv(values, w)
        for w in range(world - 1):
            dist.send(header, w)
            if kind == "sync":
                dist.send(values, w)
dist.destroy_process_group()
"""


def children_cpu() -> float:
    """CPU-seconds (user + system) of every reaped descendant of this process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def command(system: str, replicas: int, steps: int, data: Path, tmp: Path, seed: int) -> list:
    """The command lines (one per process this script starts) of one run."""
    args = [str(data), str(steps), str(BATCH), str(LR), str(seed)]
    if system == "plain":
        return [[sys.executable, "-c", PLAIN, *args]]
    if system.startswith("bytes-"):  # a shard besides R workers, or R ranks of a ring
        kind, store = system.removeprefix("bytes-"), tmp / f"store{time.monotonic_ns()}"
        world = replicas if kind == "ring" else replicas + 1
        return [
            [
                sys.executable,
                "-c",
                FLOOR,
                kind,
                str(steps),
                str(r),
                str(world),
                str(store),
                str(VALUES),
            ]
            for r in range(world)
        ]
    if system == "ddp":
        out, store = tmp / f"ddp{time.monotonic_ns()}", tmp / f"store{time.monotonic_ns()}"
        return [
            [sys.executable, "-c", DDP, *args, str(r), str(replicas), str(out), str(store), ""]
            for r in range(replicas)
        ]
    mode = system.removeprefix("netpart-")
    return [
        [
            str(Path(sys.executable).with_name("netpart")),
            "train",
            "--model",
            "digits-mlp",
            "--workers",
            "1",
            "--replicas",
            str(replicas),
            "--ps-shards",
            "1",
            "--mode",
            mode,
            "--optimizer",
            "sgd",
            "--lr",
            str(LR),
            "--data",
            "digits",
            "--steps",
            str(steps),
            "--batch",
            str(BATCH),
            "--n-push",
            "1",
            "--n-fetch",
            "1",
            "--seed",
            str(seed),
            "--out",
            str(tmp / f"np{time.monotonic_ns()}"),
        ]
    ]


def run(system: str, replicas: int, steps: int, data: Path, tmp: Path, seed: int) -> dict:
    """CPU-seconds and wall seconds of one run of `steps` steps per replica."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for c in command(system, replicas, steps, data, tmp, seed)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{system} R={replicas} failed: {err.decode()[-500:]}")
    return {
        "cpu_s": children_cpu() - cpu0,
        "wall_s": time.perf_counter() - t0,
        "samples": steps * BATCH * replicas,
    }


def marginal(short: dict, long: dict) -> float:
    """CPU-seconds per sample between the two lengths."""
    return (long["cpu_s"] - short["cpu_s"]) / (long["samples"] - short["samples"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="cost-bench-") as name:
        tmp = Path(name)
        data = tmp / "digits.npz"
        prepare_data(data)
        for rnd in range(args.rounds):
            order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
            for system, replicas in order:
                short = run(system, replicas, SHORT, data, tmp, rnd)
                long = run(system, replicas, LONG, data, tmp, rnd)
                us = marginal(short, long) * 1e6
                runs.setdefault(f"{system}/R={replicas}", []).append(
                    {"short": short, "long": long, "cpu_us_per_sample": us}
                )
                print(
                    f"round {rnd + 1} {system} R={replicas}: {us:.1f} CPU-us a sample "
                    f"(CPU {short['cpu_s']:.1f} / {long['cpu_s']:.1f} s, wall "
                    f"{short['wall_s']:.1f} / {long['wall_s']:.1f} s)",
                    flush=True,
                )
    summary = {
        k: {
            "cpu_us_per_sample_median": statistics.median(r["cpu_us_per_sample"] for r in v),
            "runs": v,
        }
        for k, v in runs.items()
    }
    ratio = {
        "downpour_R1_over_plain": summary["netpart-downpour/R=1"]["cpu_us_per_sample_median"]
        / summary["plain/R=1"]["cpu_us_per_sample_median"],
        "sync_R2_over_ddp_R2": summary["netpart-sync/R=2"]["cpu_us_per_sample_median"]
        / summary["ddp/R=2"]["cpu_us_per_sample_median"],
    }
    cost = {k: v["cpu_us_per_sample_median"] for k, v in summary.items()}
    # the best each target's system could do: its peer's cost plus what its bytes alone
    # cost beyond the peer's
    ratio["downpour_R1_floor_over_plain"] = (cost["plain/R=1"] + cost["bytes-push/R=1"]) / cost[
        "plain/R=1"
    ]
    ratio["sync_R2_floor_over_ddp_R2"] = (
        cost["ddp/R=2"] + cost["bytes-sync/R=2"] - cost["bytes-ring/R=2"]
    ) / cost["ddp/R=2"]
    print()
    for key, s in summary.items():
        print(f"{key:<22} {s['cpu_us_per_sample_median']:8.1f} CPU-us a sample (median)")
    print(f"netpart Downpour R=1 / plain: {ratio['downpour_R1_over_plain']:.2f} (target <= 1.3)")
    print(f"netpart sync R=2 / DDP R=2:   {ratio['sync_R2_over_ddp_R2']:.2f} (target <= 1.0)")
    print(
        f"their bytes alone: plain + a push {ratio['downpour_R1_floor_over_plain']:.2f} x "
        f"plain; DDP + a sync exchange's bytes beyond the ring's "
        f"{ratio['sync_R2_floor_over_ddp_R2']:.2f} x DDP"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        job = {"short_steps": SHORT, "long_steps": LONG, "batch": BATCH, "lr": LR}
        args.out.write_text(json.dumps({"job": job, "ratios": ratio, "results": summary}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
