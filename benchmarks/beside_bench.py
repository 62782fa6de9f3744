"""What the parameter server's calibration tables leave out, on emulated machines (issue 47):
a Downpour worker's step beside its courier on a share of a core, and where an exchange's
time steps with the size of a shard's message.

1. **Beside.** One client of `--shards` shards exchanges digits-mlp's 340 KB each way per
   step, as a Downpour (and a sync) worker does: alone (what `netpart calibrate` times), and with
   digits-mlp's step (64-256-256-10, batch 32: netpart's runtime, one worker) run before each
   request, as a training step runs (sync: then the exchange; Downpour: beside the request in
   flight: `netpart.ps.timed_exchange.ps_loop`'s `beside`); and that step alone on one machine.
   Beside it, what `netpart plan --machines` prices (`netpart.planning.cluster`, with
   `--profile`): the longer of the exchange and the step's CPU over the share plus the
   exchange's busy time.
   And the training job itself (`netpart train`, one replica of one worker and the same
   shards, `--train-steps` steps of the digits, on a testbed of its own machines): its step
   and its worker's CPU per step (the metrics' `cpu_s`, the first fifth of the steps left
   out). Less the step beside the exchange, that is the training loop's own CPU a step
   (binding fetched values, the gradient buffers, the batch, the metrics line):
   `netpart.planning.cluster.LOOP_CPU_S`, and over the profile's smallest dense slice,
   `LOOP_DENSE_SLICES`.
2. **Sizes.** One sync client of 4 shards at 60 to 128 KiB a message: the step at 64 KiB
   that the tables' sizes keep off (`netpart.calibrate.pstables`).

Each run is one process per machine of a testbed (`netpart testbed`), file rendezvous, gloo
over the machines' links; `--rounds` rounds, the cases rotated, medians. Needs root.

    python benchmarks/beside_bench.py \
        --profile benchmarks/results/testbed_profile_m6_c0.3.json \
        --out benchmarks/results/beside_bench.json
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

from netpart.cost.step import NetworkModel
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.planning.cluster import Layout, advise
from netpart.testbed.bed import down, up

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_bench import BATCH, parts  # sibling scripts
from cluster_bench import train as train_layout
from ps_exchange_bench import role_out

DIGITS_BYTES = 340_008  # digits-mlp's values, 4 bytes each: a replica's push, and its fetch
MESSAGE_KIB = (60, 63, 64, 65, 72, 80, 96, 128)  # a message to each of 4 shards

ROLE = r"""
import json, sys
import torch, torch.distributed as dist
from netpart.models import load_spec
from netpart.partition.planner import plan
from netpart.ps.timed_exchange import ps_loop, timed_calls
from netpart.runtime.check import lone_step

rank, world, shards, repeats, nbytes = map(int, sys.argv[1:6])
store, mode, beside = sys.argv[6], sys.argv[7], sys.argv[8] == "beside"
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
solo = dist.new_group([0])  # worker 0's own: a 1-worker replica's transport
step = None
if rank == 0:  # the client's machine: the shards' need no model
    spec = load_spec("digits-mlp")
    step = lone_step(spec, plan(spec, 1, seed=0, batch=32), solo, 0)

if world == 1:  # the step alone, back to back
    print(json.dumps(timed_calls(step, repeats)))
else:
    group = dist.new_group(list(range(world)))
    seconds, cpu = ps_loop(group, rank, mode, [nbytes], repeats, shards, step if beside else None)
    if rank == 0:
        print(json.dumps([seconds[0], cpu[0]]))
dist.destroy_process_group()
"""


def run(bed: str, case: tuple, repeats: int, tmp: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) per step of client 0 in `case`: (mode, shards, bytes, beside);
    shards 0: the step alone on machine 0; beside "train": the training job."""
    mode, shards, nbytes, beside = case
    if beside == "train":
        # a training job takes every machine of its testbed: the one of 1 + shards
        return train(_train_bed(bed), mode, shards, repeats, tmp / f"run{time.monotonic_ns()}")
    world = 1 + shards if shards else 1
    store = tmp / f"store{time.monotonic_ns()}"
    args = [
        str(world),
        str(shards),
        str(repeats),
        str(nbytes),
        str(store),
        mode,
        "beside" if beside else "alone",
    ]
    seconds, cpu = json.loads(role_out(bed, ROLE, world, args, str(case)))
    return seconds, cpu


def _train_bed(name: str) -> str:
    """The testbed of 1 + shards machines beside testbed `name`, for the training job."""
    return f"{name}t"


def train(bed: str, mode: str, shards: int, steps: int, out: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of the worker's process) per step of digits-mlp trained by
    `netpart train` on testbed `bed`, one replica of one worker and `shards` shards."""
    job = argparse.Namespace(model="digits-mlp", steps=steps, data="digits")
    samples_per_s = train_layout(bed, Layout(mode, 1, 1, shards), job, out)
    cpu = parts(out, 1)["cpu_s"]
    shutil.rmtree(out, ignore_errors=True)
    return BATCH / samples_per_s, cpu


def _cases(shards: int, nbytes: int, only: set[str]) -> list[tuple]:
    kinds = [
        b for b in (False, True, "train") if {False: "alone", True: "beside"}.get(b, b) in only
    ]
    beside = [(m, shards, nbytes, b) for m in ("downpour", "sync") for b in kinds]
    sizes = [("sync", 4, 4 * 1024 * k, False) for k in MESSAGE_KIB] if "sizes" in only else []
    return [("step", 0, 0, True), *beside, *sizes]


def _priced(network: NetworkModel, shards: int) -> dict[str, float]:
    """What `netpart plan --machines` prices digits-mlp's one replica of one worker and
    `shards` shards at (a replica's step, seconds), Downpour and sync."""
    advice = advise(load_spec("digits-mlp"), shards + 1, network, batch=32)
    return {
        m: f.step_s
        for f in advice.layouts
        for m in ("downpour", "sync")
        if str(f.layout) == f"{m} 1x1+{shards}"
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=1000)
    ap.add_argument(
        "--only",
        default="alone,beside,train,sizes",
        help="which cases beside the step alone (default: all)",
    )
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    name = f"bsb{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="beside-"))
    cases = _cases(args.shards, DIGITS_BYTES, set(args.only.split(",")))
    up(name, max(1 + args.shards, 5), cpu=args.cpu, rate=args.link)
    trains = any(case[3] == "train" for case in cases)
    if trains:
        up(_train_bed(name), 1 + args.shards, cpu=args.cpu, rate=args.link)
    seen: dict[tuple, list] = {c: [] for c in cases}
    try:
        for k in range(args.rounds):
            for case in cases[k % len(cases) :] + cases[: k % len(cases)]:
                steps = args.train_steps if case[3] == "train" else args.repeats
                seen[case].append(run(name, case, steps, tmp))
            print(f"round {k + 1} done", flush=True)
    finally:
        down(name)
        if trains:
            down(_train_bed(name))
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        {
            "mode": m,
            "shards": s,
            "bytes": b,
            "beside": bes,
            "seconds": statistics.median(t for t, _ in seen[(m, s, b, bes)]),
            "rounds": [t for t, _ in seen[(m, s, b, bes)]],
            "cpu": statistics.median(c for _, c in seen[(m, s, b, bes)]),
        }
        for m, s, b, bes in cases
    ]
    for r in rows:
        what = (
            "step alone"
            if r["mode"] == "step"
            else (
                f"{r['mode']:<8} 1 client of {r['shards']} shards, {r['bytes'] / 1024:6.1f} KiB"
                f"{', the training job' if r['beside'] == 'train' else ''}"
                f"{', step beside' if r['beside'] is True else ''}"
            )
        )
        print(f"{what}: {r['seconds'] * 1e3:6.2f} ms, CPU {r['cpu'] * 1e3:5.2f} ms")
    for m in ("downpour", "sync"):
        got = {r["beside"]: r["cpu"] for r in rows if r["mode"] == m and r["shards"] == args.shards}
        if "train" in got and True in got:
            print(
                f"{m}: the training loop's own CPU a step {(got['train'] - got[True]) * 1e3:.2f} "
                "ms (the training job's less the step beside the exchange)"
            )
    result = {
        "cpu": args.cpu,
        "link": args.link,
        "repeats": args.repeats,
        "train_steps": args.train_steps,
        "rounds": args.rounds,
        "profile": str(args.profile) if args.profile else None,
        "rows": rows,
    }
    if args.profile is not None:
        network = NetworkModel.from_profile(args.profile.read_text(), str(args.profile))
        result["priced"] = _priced(network, args.shards)
        said = ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in result["priced"].items())
        print(f"priced by the profile, digits-mlp 1x1+{args.shards}: {said}")
    if args.out is not None:
        write_atomic(args.out, json.dumps(result, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
