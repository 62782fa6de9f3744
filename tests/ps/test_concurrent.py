"""No update lost or torn: R replica processes push known gradients to two shard processes at
once, through the real client (courier thread, pipelined requests, pushes of several chunks;
or, as with local steps, posted from the caller with CURRENT answers allowed), and every
shard's final values are exactly what the sum of all pushes makes them. In sync mode every
replica's fetch of step t shows exactly the values after step t."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import finish

REPLICAS, SHARDS, STEPS, CHUNK = 3, 2, 40, 1000

SETUP = """
import json, os, sys
import numpy as np, torch, torch.distributed as dist
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.compile.shards import ShardLayout
from netpart.ps import Downpour, Optimizer, ShardClient, ShardServer, ShardSetup, ShardState, Sync
from netpart.ps import client, protocol, server, make_rule

rank, store, mode, (replicas, shards, steps, chunk, local) = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], map(int, sys.argv[4:]))
for module in (protocol, client, server):  # small chunks: pushes and replies in several
    module.CHUNK = chunk
dist.init_process_group("gloo", store=dist.FileStore(store, replicas + shards), rank=rank,
                        world_size=replicas + shards)
spec = load_spec("digits-mlp")
p = plan(spec, 1, "metis")
layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 1, shards)
if rank >= replicas:  # a shard: zeros, SGD with lr 1
    s = rank - replicas
    values = torch.zeros(int(layout.bounds[s + 1] - layout.bounds[s]), dtype=torch.float64)
    setup = ShardSetup(layout, s, replicas, rank, lambda r, w: r)
    rule = make_rule(Optimizer("sgd", 1.0), values)
    srv = ShardServer(setup, ShardState(values, None), Sync() if mode == "sync" else Downpour(),
                      rule)
    srv.serve()
    print(json.dumps({"shard": s, "updates": srv.state.updates,
                      "distinct": np.unique(values.numpy()).tolist()}))
    sys.stdout.flush()
    os._exit(0)  # as the real roles end: peer threads may still sit in gloo calls
"""

DOWNPOUR = """
# A replica: pushes (rank + 1) * step everywhere, two requests in flight, and checks that
# every fetch shows each shard's values at one moment (one value across its range).
c = ShardClient(layout, worker=0, replica=rank, rank=rank,
                shard_ranks=list(range(replicas, replicas + shards)),
                dtype=torch.float64, depth=3, background=not local, local_steps=bool(local))
routes = c.routes
bufs = c.push_buffers(3)
torn, current, inflight = 0, 0, []
for step in range(1, steps + 1):
    bufs[step % 3].fill_(float((rank + 1) * step))
    while len(inflight) > 1:
        ticket = inflight.pop(0)
        got = c.complete(ticket)
        current += len(ticket.current)  # answered without values (2-38 of 78 seen)
        for s, segs in routes.items():
            if s not in ticket.current:
                part = torch.cat([got[g.local_lo:g.local_lo + g.length] for g in segs])
                torn += int(torch.unique(part).numel() != 1)
    ahead = len(inflight) if local else 0  # as local steps claim the versions they hold
    inflight.append(c.request(step, bufs[step % 3], fetch=True, ahead=ahead))
c.close()
print(json.dumps({"replica": rank, "torn": torn, "current": current}))
sys.stdout.flush()
os._exit(0)
"""

SYNC = """
# A replica pushes (rank + 1) * step: the mean over replicas is (R + 1) / 2 * step.
c = ShardClient(layout, worker=0, replica=rank, rank=rank,
                shard_ranks=list(range(replicas, replicas + shards)), dtype=torch.float64)
buf = c.push_buffers(1)[0]
c.complete(c.request(0, fetch=True))
wrong = []
for step in range(1, steps + 1):
    buf.fill_(float((rank + 1) * step))
    got = c.complete(c.request(step, buf, fetch=True))
    want = -(replicas + 1) / 2 * step * (step + 1) / 2
    if c.version != step or not bool((got == want).all()):
        wrong.append(step)
c.close()
print(json.dumps({"replica": rank, "wrong": wrong}))
sys.stdout.flush()
os._exit(0)
"""


def _job(tmp_path, mode: str, chunk: int, local: int = 0) -> list[dict]:
    """Every process's last output line (JSON): the replicas', then the shards'."""
    args = [str(tmp_path / "store"), mode, *map(str, (REPLICAS, SHARDS, STEPS, chunk, local))]
    role = SETUP + (SYNC if mode == "sync" else DOWNPOUR)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", role, str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(REPLICAS + SHARDS)
    ]
    outs = finish(procs, 120)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize("local", [0, 1])
def test_concurrent_pushes_are_all_applied_whole(tmp_path, local):
    reports = _job(tmp_path, "downpour", CHUNK, local)
    pushed = sum((r + 1) * s for r in range(REPLICAS) for s in range(1, STEPS + 1))
    for rep in reports[:REPLICAS]:
        assert rep["torn"] == 0
    for rep in reports[REPLICAS:]:
        assert rep["updates"] == REPLICAS * STEPS  # none lost
        assert rep["distinct"] == [-float(pushed)]  # every value got every push, whole


@pytest.mark.parametrize("chunk", [CHUNK, 1 << 20])  # replies apart, and in one message
def test_sync_fetches_show_exactly_the_step_they_wait_for(tmp_path, chunk):
    reports = _job(tmp_path, "sync", chunk)
    assert [r["wrong"] for r in reports[:REPLICAS]] == [[]] * REPLICAS
    assert [r["updates"] for r in reports[REPLICAS:]] == [STEPS] * SHARDS
