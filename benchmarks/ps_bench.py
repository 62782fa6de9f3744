"""Parameter-server benchmark, each figure a ratio measured side by side in one run.

(a) Shard throughput: one model worker pushes its gradients to and fetches its parameters from
    its shard (ShardClient -> ShardServer, headers, update rule and all) vs raw gloo send/recv
    of the same bytes between the same two processes. Worker 0 of image-80m on 16 workers
    (16 shards: shard 0 holds exactly worker 0's 4.8M values). First on this machine's
    loopback, where moving the bytes is a memory copy that keeps both cores busy, so the
    shard's update cannot hide behind it; then between two network namespaces over a link
    tbf-limited to each `--links` rate (emulated machines: the link, not the copy, is slow).
(b) A replica's step time with Downpour (n_push = n_fetch = 1, SGD) vs the same partitioned
    step followed by plain SGD on each worker's own parameters, no parameter server:
    bench-local (10M parameters) on 2 workers, 2 shards, batch 32 and 128, median step over
    alternating runs. Shards share this machine's 2 cores with the workers.

    python benchmarks/ps_bench.py --out benchmarks/results/ps_bench.json   # links need root
    python benchmarks/ps_bench.py --only b --batches 32 --pairs 5 \
        --out benchmarks/results/ps_bench_b.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import parser, write_results

from netpart.compile.schedule import NO_SPLITS, plan_schedule
from netpart.compile.shards import ShardLayout
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.processes.launcher import join_group, reaped, wait_all
from netpart.ps import (
    Downpour,
    Optimizer,
    ShardClient,
    ShardServer,
    ShardSetup,
    ShardState,
    make_rule,
)
from netpart.runtime.check import make_batch
from netpart.runtime.transport import GlooTransport
from netpart.runtime.worker import ModelWorker
from netpart.train import train
from netpart.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LINK_BURST = "1mb"  # token bucket of the emulated link: >= rate / HZ at 1 Gbit/s


def _layout() -> ShardLayout:
    spec = load_spec("image-80m")
    p = plan(spec, 16, "metis")
    return ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 16, 16)


def _peer(
    rank: int, addr: str, port: int, iters: int, rounds: int, optimizer: str, result: Path
) -> None:
    """One of the two processes of (a): rank 0 = model worker 0, rank 1 = shard 0."""
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    layout = _layout()
    n = layout.worker_size(0)
    assert list(layout.routes(0)) == [0], "worker 0 should talk to shard 0 only"
    buf = torch.randn(n)
    grads = torch.randn(n)
    raw_s, ps_s = [], []
    for _ in range(rounds):  # alternate raw and PS rounds: the machine is noisy
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):  # raw gloo: the same bytes each way, a round trip each
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        raw_s.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 1:
            values = torch.zeros(n)
            rule = make_rule(Optimizer(optimizer, 0.01), values)
            setup = ShardSetup(layout, 0, 1, rank=1, rank_of=lambda r, w: 0)
            server = ShardServer(setup, ShardState(values=values, state=None), Downpour(), rule)
            server.serve()
            continue
        client = ShardClient(
            layout, worker=0, replica=0, rank=0, shard_ranks=[1] + [-1] * 15, dtype=torch.float32
        )
        t0 = time.perf_counter()
        for step in range(1, iters + 1):
            got = client.complete(client.request(step, grads, fetch=True))
        ps_s.append(time.perf_counter() - t0)
        if optimizer == "sgd":  # every chunk of every push landed where it belongs
            want = -0.01 * iters * grads
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-5), "shard values are wrong"
        client.close()
    if rank == 0:
        mb = 2 * n * 4 * iters / 1e6
        ratios = [r / p for r, p in zip(raw_s, ps_s, strict=True)]
        result.write_text(
            json.dumps(
                {
                    "values": n,
                    "iterations": iters,
                    "rounds": rounds,
                    "raw_MBps": [mb / t for t in raw_s],
                    "ps_MBps": [mb / t for t in ps_s],
                    "ratios": ratios,
                    "median_ratio": statistics.median(ratios),
                }
            )
        )
    os._exit(0)


def shard_throughput(
    iters: int, rounds: int, optimizer: str, rate: str | None = None
) -> dict | None:
    """(a) between two processes here (loopback), or with `rate` between two network
    namespaces joined by a link tbf-limited to `rate` each way (None if they cannot be made)."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        result = Path(tmp) / "r.json"
        argv = [
            sys.executable,
            __file__,
            "--iters",
            str(iters),
            "--rounds",
            str(rounds),
            "--optimizer",
            optimizer,
            "--result",
            str(result),
        ]

        def peer(rank: int, addr: str, port: int) -> list[str]:
            return [*argv, "--peer", str(rank), "--addr", addr, "--port", str(port)]

        if rate is None:
            store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
            port = store.port
            del store
            commands = [peer(r, "127.0.0.1", port) for r in (0, 1)]
        else:
            from netpart.testbed import netns

            why = netns.unavailable()
            if why is not None:
                print(f"skipping (a) over a link: {why}")
                return None
            hosts = stack.enter_context(netns.two_hosts(rate=rate, burst=LINK_BURST))
            env = {"PYTHONPATH": str(ROOT)}
            commands = [
                h.command(peer(r, hosts[0].address, 29591), {**env, "GLOO_SOCKET_IFNAME": h.device})
                for r, h in enumerate(hosts)
            ]
        with reaped([subprocess.Popen(c) for c in commands]) as procs:
            wait_all(procs, 900, f"a peer of (a) ({optimizer}, link {rate})")
        return {
            "optimizer": optimizer,
            "link": rate or "loopback",
            **json.loads(result.read_text()),
        }


def _median_step(run: Path, skip: int) -> float:
    lines = (run / "metrics_replica0.jsonl").read_text().splitlines()
    times = [json.loads(x)["time"] for x in lines]
    steps = [b - a for a, b in itertools.pairwise(times)][skip:]
    return statistics.median(steps)


def _own_sgd_worker(rank: int, store: str, steps: int, batch: int, lr: float, out: Path) -> None:
    """One of two worker processes of bench-local's step followed by plain SGD on the
    worker's own parameters (no parameter server, no data loading, no metrics); rank 0
    writes each step's time on the slower worker to `out`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", NETPART_STORE=store)
    join_group(60.0)
    torch.set_num_threads(1)
    spec = load_spec("bench-local")
    graph, schedule = plan_schedule(spec, plan(spec, 2, "metis"), split_min_flops=NO_SPLITS)
    worker = ModelWorker(spec, graph, schedule, rank, seed=0, dtype=torch.float32)
    x, y = make_batch(spec, batch, 0)
    transport, times = GlooTransport(), []
    for _ in range(steps):
        worker.zero_grad()
        transport.barrier()
        start = time.perf_counter()
        worker.step(x.float(), y, transport, collect_grads=False)
        params = [p for p in worker.parameters() if p.grad is not None]
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)
        times.append(time.perf_counter() - start)
    slower = transport.all_reduce(torch.tensor(times, dtype=torch.float64), "max")
    if rank == 0:
        out.write_text(json.dumps(slower.tolist()))
    dist.destroy_process_group()


def _own_sgd(steps: int, batch: int, lr: float) -> list[float]:
    """Each step's seconds (slower worker) of the own-SGD baseline, two processes here."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        argv = [
            sys.executable,
            __file__,
            "--own-sgd",
            tmp,
            "--steps",
            str(steps),
            "--batches",
            str(batch),
            "--lr",
            str(lr),
        ]
        with reaped([subprocess.Popen([*argv, "--peer", str(r)]) for r in (0, 1)]) as procs:
            wait_all(procs, 600, "a worker of the own-SGD baseline")
        return json.loads(out.read_text())


def downpour_step(pairs: int, steps: int, batch: int) -> dict:
    """Downpour's median step (the replica's loop: data, step, push and fetch, metrics) vs the
    same partitioned step followed by plain SGD on each worker's own parameters, without a
    parameter server (`_own_sgd`: no data loading, no metrics, so the ratio charges every
    cost of the training loop to the parameter server), alternating."""
    spec = load_spec("bench-local")
    p = plan(spec, 2, "metis")
    lr = 0.01
    base = dict(replicas=1, shards=2, steps=steps, batch=batch, lr=lr, timeout=60)
    config = TrainConfig.of(**base, optimizer="sgd")
    downpour, local, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            a = Path(tmp) / f"ps{i}"
            train(spec, p, config, a)
            per_step = _own_sgd(steps, batch, lr)
            downpour.append(_median_step(a, 3))
            local.append(statistics.median(per_step[3:]))
            ratios.append(downpour[-1] / local[-1])
    return {
        "model": spec.name,
        "workers": 2,
        "shards": 2,
        "batch": batch,
        "steps": steps,
        "optimizer": "sgd",
        "downpour_step_s": downpour,
        "own_sgd_step_s": local,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
    }


def main() -> None:
    ap = parser("ps_bench", __doc__)
    ap.set_defaults(rounds=7)  # alternating raw/PS rounds
    ap.add_argument("--iters", type=int, default=10, help="push+fetch round trips per round")
    ap.add_argument(
        "--links",
        default="1gbit,10gbit",
        help="(a) also between two namespaces over a link of each rate ('' for none)",
    )
    ap.add_argument("--batches", default="32,128", help="batch sizes for (b)")
    ap.add_argument("--only", choices=("a", "b"), default=None, help="run only (a) or (b)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", default="sgd", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--own-sgd", default=None, help=argparse.SUPPRESS)  # a baseline worker
    ap.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.own_sgd is not None:
        store, out = str(Path(args.own_sgd) / "store"), Path(args.own_sgd) / "times.json"
        _own_sgd_worker(args.peer, store, args.steps, int(args.batches), args.lr, out)
        return
    if args.peer is not None:
        _peer(args.peer, args.addr, args.port, args.iters, args.rounds, args.optimizer, args.result)
        return
    torch.set_num_threads(1)
    out = {
        "shard_throughput": [
            got
            for rate in [None, *filter(None, args.links.split(","))]
            for o in ("sgd", "adagrad")
            if args.only in (None, "a")
            and (got := shard_throughput(args.iters, args.rounds, o, rate)) is not None
        ],
        "downpour_step": [
            downpour_step(args.pairs, args.steps, int(b))
            for b in args.batches.split(",")
            if args.only in (None, "b")
        ],
    }
    print(json.dumps(out, indent=1))
    write_results(args.out, out)


if __name__ == "__main__":
    main()
