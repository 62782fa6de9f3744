"""The parameter server's sync exchange of several clients, alone and after a training step,
on emulated machines (issue 47).

`netpart calibrate` times C clients of S shards exchanging back to back, every client at
once (`netpart.ps.timed_exchange.ps_loop`, no `beside`), and since 2026-11-28 again after a stand-in
step (its `ps.after`). In training each client first runs its replica's step, and on
0.3-core testbed machines bench-local's sync 2x1+2 exchange took 1.22-1.26x what the first
table reads and 3x1+1's 0.79-0.86x (docs/planning.md). This times, per (clients, shards),
client 0's request-to-request seconds and its process's CPU: `alone` (as the calibration's
first tables) and `beside` (every client runs the model's one-worker step, netpart's
runtime, before each request, as a sync training step does), and the step alone on one
machine; with `--stand-in CPU_S` also after the calibration's stand-in step
(`netpart.ps.timed_exchange.stand_in`: that much CPU, not the model's). Each run is one process per
machine of a testbed of its own (`netpart testbed`), file rendezvous, gloo over the
machines' links; `--rounds` rounds, the cases rotated, medians. With `--rings K,...`, the
all-reduce among K machines (DDP's ring, `ps_loop`'s mode `allreduce`) the same three ways,
every machine running the step before each (the slowest machine's figures). Needs root.

    python benchmarks/clients_bench.py --out benchmarks/results/clients_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.testbed.bed import down, up

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ps_exchange_bench import role_out  # a sibling script

ROLE = r"""
import json, sys
import torch, torch.distributed as dist
from netpart.models import load_spec
from netpart.partition.planner import plan
from netpart.ps.timed_exchange import ALLREDUCE, ps_loop, stand_in, timed_calls
from netpart.runtime.check import lone_step

rank, world, shards, repeats, nbytes = map(int, sys.argv[1:6])
store, model_name, how = sys.argv[6], sys.argv[7], sys.argv[8]
beside = how != "alone"
torch.set_num_threads(1)
torch.set_flush_denormal(True)  # as netpart's training processes
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
clients = max(1, world - shards)
solos = [dist.new_group([c]) for c in range(clients)]  # each client's 1-worker replica
step = None
if rank < clients and how.startswith("stand-in"):  # "stand-in <CPU s>": not the model's step
    step = stand_in(float(how.split()[1]), nbytes // 4)
elif rank < clients and (beside or world == 1):
    spec = load_spec(model_name)
    step = lone_step(spec, plan(spec, 1, seed=0, batch=32), solos[rank], rank)
if shards == 0 and world == 1:  # the step alone, back to back
    print(json.dumps(timed_calls(step, repeats)))
elif shards == 0:  # every machine all-reduces, as DDP's replicas (the slowest's figures)
    group = dist.new_group(list(range(world)))
    (t,), (c,) = ps_loop(group, rank, ALLREDUCE, [nbytes], repeats, 0, step if beside else None)
    slowest = torch.tensor([t, c], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        print(json.dumps(slowest.tolist()))
else:
    group = dist.new_group(list(range(world)))
    seconds, cpu = ps_loop(group, rank, "sync", [nbytes], repeats, shards, step)
    if rank == 0:
        print(json.dumps([seconds[0], cpu[0]]))
dist.barrier()  # every rank's groups closed together (gloo aborts a process otherwise)
dist.destroy_process_group()
"""


def run(bed: str, case: tuple, args, nbytes: int, tmp: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) of client 0 in `case` (clients, shards, "alone"|"beside");
    shards 0: the step alone on machine 0 (1 client), or the all-reduce among the clients."""
    clients, shards, how = case
    world = clients + shards
    store = tmp / f"store{time.monotonic_ns()}"
    argv = [str(world), str(shards), str(args.repeats), str(nbytes), str(store), args.model, how]
    return tuple(json.loads(role_out(bed, ROLE, world, argv, str(case))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-local")
    ap.add_argument("--pairs", default="2x2,3x1,1x3", help="clients x shards, comma-separated")
    ap.add_argument(
        "--rings",
        default="",
        help="numbers of machines (comma-separated) whose all-reduce to time the same ways",
    )
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--stand-in",
        type=float,
        default=0.0,
        metavar="CPU_S",
        help="also time each pair after a stand-in step of this much CPU "
        "(netpart.ps.timed_exchange.stand_in) in place of the model's",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    spec = load_spec(args.model)
    nbytes = 4 * spec.num_params  # a replica's push, and its fetch
    pairs = [tuple(int(v) for v in p.split("x")) for p in args.pairs.split(",") if p]
    pairs += [(int(k), 0) for k in args.rings.split(",") if k]  # a ring: no shards
    hows = ("alone", "beside") + ((f"stand-in {args.stand_in:g}",) if args.stand_in else ())
    cases = [(1, 0, "alone")] + [(c, s, how) for c, s in pairs for how in hows]
    if args.stand_in:
        cases.insert(1, (1, 0, hows[-1]))
    name = f"clb{os.getpid() % 100000}"
    up(name, max(c + s for c, s, _ in cases), cpu=args.cpu, rate=args.link)
    tmp = Path(tempfile.mkdtemp(prefix="clients-"))
    seen: dict[tuple, list] = {c: [] for c in cases}
    try:
        for k in range(args.rounds):
            for case in cases[k % len(cases) :] + cases[: k % len(cases)]:
                seen[case].append(run(name, case, args, nbytes, tmp))
                s, c = seen[case][-1]
                print(f"round {k + 1}: {case}: {s * 1e3:.0f} ms, CPU {c * 1e3:.0f} ms", flush=True)
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        {
            "clients": c,
            "shards": s,
            "how": how,
            "seconds": statistics.median(t for t, _ in seen[(c, s, how)]),
            "rounds": [t for t, _ in seen[(c, s, how)]],
            "cpu": statistics.median(u for _, u in seen[(c, s, how)]),
        }
        for c, s, how in cases
    ]
    step = rows[0]["seconds"]
    for r in rows[1:]:
        less = (
            f", less the step alone {(r['seconds'] - step) * 1e3:.0f}"
            if r["how"] == "beside"
            else ""
        )
        what = (
            "the step alone"
            if r["clients"] == 1 and r["shards"] == 0
            else f"all-reduce among {r['clients']}"
            if r["shards"] == 0
            else f"{r['clients']} clients x {r['shards']} shards"
        )
        print(
            f"{what} {r['how']:<6}: {r['seconds'] * 1e3:.0f} ms{less}, CPU {r['cpu'] * 1e3:.0f} ms"
        )
    print(f"the step alone: {step * 1e3:.0f} ms, CPU {rows[0]['cpu'] * 1e3:.0f} ms")
    if args.out is not None:
        result = {
            "model": args.model,
            "bytes": nbytes,
            "cpu": args.cpu,
            "link": args.link,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "rows": rows,
        }
        write_atomic(args.out, json.dumps(result, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
