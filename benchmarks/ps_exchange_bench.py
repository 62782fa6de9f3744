"""The parameter server's exchange on emulated machines (issue 47): what `netpart calibrate`
measures (`netpart.ps.timed_exchange`: clients of one shard, one client of several shards, several
of several) side by side on one testbed, with the profile's reading where one is given.

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
    python benchmarks/ps_exchange_bench.py --configs 1x3,2x2 --sizes 4e6,16e6,40e6 \
        --repeats 10 --rounds 2 --profile benchmarks/results/testbed_profile_m6_c0.3.json \
        --out benchmarks/results/ps_exchange_bench_large.json
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

from netpart.cost.step import NetworkModel
from netpart.files import write_atomic
from netpart.testbed.bed import down, read, up

CONFIGS = ((1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (2, 2))  # (clients, shards)
SIZES = (65536, 340000, 1048576)  # bytes each way per client; 340 KB: the digits MLP
MODES = ("sync", "downpour")

ROLE = r"""
import json, sys
import torch, torch.distributed as dist
from netpart.ps.timed_exchange import ps_loop
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
    each machine's own link); rank 0's last line of output. SystemExit naming `what`, the
    first rank that failed, its exit code and its stderr's tail if any rank fails."""
    testbed = read(bed)
    procs = [
        subprocess.Popen(
            testbed.command(
                r,
                [sys.executable, "-c", role, str(r), *args],
                {"GLOO_SOCKET_IFNAME": testbed.hosts[r].device},
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        r, code = failed[0]
        raise SystemExit(f"{what}: rank {r} exited {code}: {outs[r][1][-600:]}")
    return outs[0][0].strip().splitlines()[-1]


def run(
    bed: str, config: tuple[int, int], repeats: int, share: float, tmp: Path, sizes: tuple[int, ...]
) -> dict:
    """{mode: (seconds per size, busy per size)} of client 0 of `config` (clients, shards)."""
    clients, shards = config
    world = clients + shards
    store = tmp / f"store{time.monotonic_ns()}"
    args = [str(world), str(store), str(shards), str(repeats), json.dumps(list(sizes))]
    got = json.loads(role_out(bed, ROLE, world, args, f"{clients} clients, {shards} shards"))
    return {m: (got[m][0], [c / share for c in got[m][1]]) for m in MODES}


def _profile_s(ps, mode: str, clients: int, shards: int, size: int) -> float | None:
    """The profile's reading of a configuration: clients of one shard, one client of several
    (its `spread`) or several of several (its `mesh`), where it has that table."""
    if shards == 1:
        return ps.seconds_s(mode, clients, size)
    if (clients == 1 and ps.spread) or (clients > 1 and ps.mesh):
        return ps.exchange_s(mode, clients, shards, size)
    return None


def _rows(seen: dict, ps, sizes: tuple[int, ...]) -> list[dict]:
    """Medians over rounds per configuration, mode and size; the profile's reading beside
    them where it has one."""
    rows = []
    for (clients, shards), runs in seen.items():
        for mode in MODES:
            for i, size in enumerate(sizes):
                row = {
                    "clients": clients,
                    "shards": shards,
                    "mode": mode,
                    "bytes": size,
                    "seconds": statistics.median(r[mode][0][i] for r in runs),
                    "busy": statistics.median(r[mode][1][i] for r in runs),
                }
                said = ""
                read = _profile_s(ps, mode, clients, shards, size) if ps is not None else None
                if read is not None:
                    row["profile_seconds"] = read
                    said = f", profile {read * 1e3:6.2f} ms"
                rows.append(row)
                ms, busy = row["seconds"] * 1e3, row["busy"] * 1e3
                print(
                    f"{clients} client(s) {shards} shard(s) {mode:<8} {size >> 10:5} KB: "
                    f"{ms:6.2f} ms, busy {busy:6.2f} ms{said}"
                )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help="bytes each way per client, comma-separated (4e6 is read as 4 MB)",
    )
    ap.add_argument(
        "--configs",
        default=",".join(f"{c}x{s}" for c, s in CONFIGS),
        help="clients x shards, comma-separated: 1x3,2x2",
    )
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sizes = tuple(int(float(b)) for b in args.sizes.split(","))
    configs = tuple(tuple(map(int, c.split("x"))) for c in args.configs.split(","))
    machines = max(c + s for c, s in configs)
    name = f"pxb{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="ps-exchange-"))
    up(name, machines, cpu=args.cpu, rate=args.link)
    seen: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    try:
        for k in range(args.rounds):
            for config in configs[k % len(configs) :] + configs[: k % len(configs)]:
                seen[config].append(run(name, config, args.repeats, args.cpu, tmp, sizes))
                print(
                    f"round {k + 1}: {config[0]} client(s), {config[1]} shard(s) done", flush=True
                )
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    ps = None
    if args.profile is not None:
        ps = NetworkModel.from_profile(args.profile.read_text(), str(args.profile)).ps
    rows = _rows(seen, ps, sizes)
    if args.out is not None:
        result = {
            "cpu": args.cpu,
            "link": args.link,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "profile": str(args.profile) if args.profile else None,
            "rows": rows,
        }
        write_atomic(args.out, json.dumps(result, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
