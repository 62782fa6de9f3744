"""The processes of the parameter-server tests that need several (`test_concurrent`,
`test_timed_exchange`): `python -m tests.ps.roles ROLE ARGS...`, forked by a preloaded
interpreter (`run_roles`), each rank printing one JSON line into its log."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from netpart.compile.shards import ShardLayout
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.processes.launcher import Processes, join_group
from netpart.processes.zygote import Preloaded
from netpart.ps import (
    Downpour,
    Optimizer,
    ShardClient,
    ShardServer,
    ShardSetup,
    ShardState,
    Sync,
    client,
    make_rule,
    protocol,
    server,
)
from netpart.ps.timed_exchange import ps_loop

MODULE = "tests.ps.roles"
TIMEOUT_S = 120.0


def run_roles(run: Path, world: int, args: list[str]) -> list[dict]:
    """Every rank's JSON line, in rank order, from `world` processes of `args` (forked by
    the test session's kept zygote of this module); an AssertionError with a failed rank's
    log."""
    logs = [run / f"rank{k}.log" for k in range(world)]
    deadline = time.monotonic() + TIMEOUT_S
    with Processes(MODULE, args, logs, preloaded=Preloaded.kept(MODULE)) as procs:
        while procs.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        codes = procs.codes()  # None: still running at the deadline (killed on leaving)
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text()[-2000:]
    return [json.loads(log.read_text().strip().splitlines()[-1]) for log in logs]


def main() -> int:
    role, *args = sys.argv[1:]
    rank, world = join_group(TIMEOUT_S)
    out = {"concurrent": concurrent, "timed": timed_exchange}[role](rank, world, *args)
    print(json.dumps(out), flush=True)
    os._exit(0)  # as the real roles end: peer threads may still sit in gloo calls


def concurrent(rank: int, world: int, mode: str, replicas: str, steps: str, chunk: str, local: str):
    """Replicas push known gradients to the shards at once (`test_concurrent`): a shard's
    update count and distinct final values, or a replica's findings."""
    replicas, steps, local = int(replicas), int(steps), bool(int(local))
    shards = world - replicas
    for module in (protocol, client, server):  # small chunks: pushes and replies in several
        module.CHUNK = int(chunk)
    spec = load_spec("digits-mlp")
    p = plan(spec, 1, "metis")
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 1, shards)
    if rank >= replicas:  # a shard: zeros, SGD with lr 1
        s = rank - replicas
        values = torch.zeros(int(layout.bounds[s + 1] - layout.bounds[s]), dtype=torch.float64)
        setup = ShardSetup(layout, s, replicas, rank, lambda r, w: r)
        rule = make_rule(Optimizer("sgd", 1.0), values)
        srv = ShardServer(
            setup, ShardState(values, None), Sync() if mode == "sync" else Downpour(), rule
        )
        srv.serve()
        distinct = np.unique(values.numpy()).tolist()
        return {"shard": s, "updates": srv.state.updates, "distinct": distinct}
    c = ShardClient(
        layout,
        worker=0,
        replica=rank,
        rank=rank,
        shard_ranks=list(range(replicas, world)),
        dtype=torch.float64,
        **({} if mode == "sync" else {"depth": 3, "background": not local, "local_steps": local}),
    )
    report = _sync(c, rank, replicas, steps) if mode == "sync" else _downpour(c, rank, steps, local)
    c.close()
    return {"replica": rank, **report}


def _downpour(c: ShardClient, rank: int, steps: int, local: bool) -> dict:
    """Pushes (rank + 1) * step everywhere, two requests in flight, and checks that every
    fetch shows each shard's values at one moment (one value across its range)."""
    routes = c.routes
    bufs = c.push_buffers(3)
    torn, current, inflight = 0, 0, []
    for step in range(1, steps + 1):
        bufs[step % 3].fill_(float((rank + 1) * step))
        while len(inflight) > 1:
            ticket = inflight.pop(0)
            got = c.complete(ticket)
            current += len(ticket.current)  # answered without values
            for s, segs in routes.items():
                if s not in ticket.current:
                    part = torch.cat([got[g.local_lo : g.local_lo + g.length] for g in segs])
                    torn += int(torch.unique(part).numel() != 1)
        ahead = len(inflight) if local else 0  # as local steps claim the versions they hold
        inflight.append(c.request(step, bufs[step % 3], fetch=True, ahead=ahead))
    return {"torn": torn, "current": current}


def _sync(c: ShardClient, rank: int, replicas: int, steps: int) -> dict:
    """Pushes (rank + 1) * step: the mean over replicas is (R + 1) / 2 * step; the steps
    whose fetch showed anything else."""
    buf = c.push_buffers(1)[0]
    c.complete(c.request(0, fetch=True))
    wrong = []
    for step in range(1, steps + 1):
        buf.fill_(float((rank + 1) * step))
        got = c.complete(c.request(step, buf, fetch=True))
        want = -(replicas + 1) / 2 * step * (step + 1) / 2
        if c.version != step or not bool((got == want).all()):
            wrong.append(step)
    return {"wrong": wrong}


def timed_exchange(rank: int, world: int, shards: str) -> dict:
    """The calibration's exchange loop in both modes, beside a stand-in step, at 4 MB, and
    the all-reduce (`test_timed_exchange`): what each call of `ps_loop` gave."""
    shards = int(shards)
    group = dist.new_group(list(range(world)))
    out = {m: ps_loop(group, rank, m, [4096, 65536], 4, shards) for m in ("sync", "downpour")}
    calls = []  # a step's stand-in before each request: 10 ms

    def beside() -> None:
        calls.append(1)
        time.sleep(0.01)

    out["beside"] = ps_loop(group, rank, "downpour", [4096], 4, shards, beside), len(calls)
    for mode in ("sync", "downpour"):  # 4 MB: fewer warm-up exchanges (`warm_exchanges`)
        calls.clear()
        large = ps_loop(group, rank, mode, [4_000_000], 2, shards, beside)
        out["large_" + mode] = large, len(calls)
    out["allreduce"] = ps_loop(group, rank, "allreduce", [4096, 65536], 2, 0)
    calls.clear()
    out["ring_beside"] = ps_loop(group, rank, "allreduce", [4096], 3, 0, beside), len(calls)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
