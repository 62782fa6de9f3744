"""The parameter server's exchange on emulated machines (issue 47): what `netpart calibrate`
measures (k clients of one shard, one client of several shards: `netpart.ps.measure`) side
by side on one testbed, with the profile's reading where one is given.

Each configuration (clients, shards) runs one process per machine of a testbed (`netpart
testbed`: a network namespace on a shaped switch and a cpu cgroup each), file rendezvous on
the shared disk, gloo over the machines' links; every client pushes and fetches each size in
all (split evenly over the shards) `--repeats` times as sync and as Downpour workers do.
Figures: per configuration, mode and size, a client's median seconds per exchange and its
CPU per exchange / the machine's share ("busy"); configurations rotated over `--rounds`,
medians. Needs root.

    python benchmarks/ps_exchange_bench.py \
        --profile benchmarks/results/testbed_profile_m4_c0.3.json \
        --out benchmarks/results/ps_exchange_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netpart.files import write_atomic
from netpart.partition.cost import NetworkModel
from netpart.testbed.bed import down, read, up

CONFIGS = ((1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (2, 2))  # (clients, shards)
SIZES = (65536, 340000, 1048576)  # bytes each way per client; 340 KB: the digits MLP
MODES = ("sync", "downpour")

ROLE = r"""
import json, sys
import torch, torch.distributed as dist
from netpart.ps.measure import ps_loop
rank, world, shards, repeats = map(int, (sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]))
store, sizes = sys.argv[3], json.loads(sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
group = dist.new_group(list(range(world)))
out = {m: ps_loop(group, rank, m, sizes, repeats, shards) for m in ("sync", "downpour")}
dist.destroy_process_group()
print(json.dumps(out))
"""


def role_out(bed: str, role: str, world: int, args: list[str], what: str) -> str:
    """Run `python -c role RANK *args` on machines 0..world-1 of testbed `bed` (gloo over
    each machine's own link); rank 0's last line of output. SystemExit naming `what` if any
    rank fails."""
    testbed = read(bed)
    procs = [
        subprocess.Popen(testbed.command(r, [sys.executable, "-c", role, str(r), *args],
                                         {"GLOO_SOCKET_IFNAME": testbed.hosts[r].device}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{what}: {outs[0][1][-600:]}")
    return outs[0][0].strip().splitlines()[-1]


def run(bed: str, clients: int, shards: int, repeats: int, share: float, tmp: Path) -> dict:
    """{mode: (seconds per size, busy per size)} of client 0."""
    world = clients + shards
    store = tmp / f"store{time.monotonic_ns()}"
    args = [str(world), str(store), str(shards), str(repeats), json.dumps(list(SIZES))]
    got = json.loads(role_out(bed, ROLE, world, args, f"{clients} clients, {shards} shards"))
    return {m: (got[m][0], [c / share for c in got[m][1]]) for m in MODES}


def _rows(seen: dict, ps) -> list[dict]:
    """Medians over rounds per configuration, mode and size; the profile's reading beside
    them: clients of one shard, or one client of several (its `spread`, where it has one)."""
    rows = []
    for (clients, shards), runs in seen.items():
        for mode in MODES:
            for i, size in enumerate(SIZES):
                row = {"clients": clients, "shards": shards, "mode": mode, "bytes": size,
                       "seconds": statistics.median(r[mode][0][i] for r in runs),
                       "busy": statistics.median(r[mode][1][i] for r in runs)}  # fmt: skip
                said = ""
                if ps is not None and (shards == 1 or (clients == 1 and ps.spread)):
                    row["profile_seconds"] = (ps.seconds_s(mode, clients, size) if shards == 1
                                              else ps.spread_s(mode, shards, size))  # fmt: skip
                    said = f", profile {row['profile_seconds'] * 1e3:6.2f} ms"
                rows.append(row)
                ms, busy = row["seconds"] * 1e3, row["busy"] * 1e3
                print(f"{clients} client(s) {shards} shard(s) {mode:<8} {size >> 10:5} KB: "
                      f"{ms:6.2f} ms, busy {busy:6.2f} ms{said}")  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    machines = max(c + s for c, s in CONFIGS)
    name = f"pxb{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="ps-exchange-"))
    up(name, machines, cpu=args.cpu, rate=args.link)
    seen: dict[tuple[int, int], list[dict]] = {c: [] for c in CONFIGS}
    try:
        for k in range(args.rounds):
            for config in CONFIGS[k % len(CONFIGS) :] + CONFIGS[: k % len(CONFIGS)]:
                seen[config].append(run(name, *config, args.repeats, args.cpu, tmp))
                print(
                    f"round {k + 1}: {config[0]} client(s), {config[1]} shard(s) done", flush=True
                )
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    ps = None
    if args.profile is not None:
        ps = NetworkModel.from_profile(args.profile.read_text(), str(args.profile)).ps
    rows = _rows(seen, ps)
    if args.out is not None:
        result = {"cpu": args.cpu, "link": args.link, "repeats": args.repeats,
                  "rounds": args.rounds, "profile": str(args.profile) if args.profile else None,
                  "rows": rows}  # fmt: skip
        write_atomic(args.out, json.dumps(result, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
