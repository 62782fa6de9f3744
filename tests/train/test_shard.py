"""A shard's checkpoints, decided in one place (`Checkpoints`): written as updates fall due,
from a thread of their own, and a failed write fails the shard in one line."""

import json
import time
import zipfile

import torch

from netpart.compile.shards import ShardLayout
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.ps import protocol
from netpart.ps.modes import Downpour
from netpart.ps.rules import Optimizer, make_rule
from netpart.ps.server import ShardServer, ShardSetup, ShardState
from netpart.train.config import TrainConfig
from netpart.train.shard import Checkpoints


class _Nobody:
    """A process group no message reaches (pushes alone need none)."""

    def send(self, tensors, dst, tag):
        raise AssertionError("nothing is answered here")

    recv = send


def _push(server, step):
    link = server.link(0, server.workers[0])
    n = link.payload.numel()
    buf = protocol.request_buffer(n, torch.float32)
    protocol.write_header(buf, int(protocol.Kind.PUSH), link.src, 0, step, n, 0, -1)
    link.request[: buf.numel()].copy_(buf)
    server.answer(link, *server.take(link))


def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_failed_checkpoint_write_fails_the_shard_and_keeps_the_last_one(tmp_path, monkeypatch):
    monkeypatch.setenv("NETPART_TEST_FAULT", "enospc:5@2")  # rank 5's second write fails
    spec = load_spec("tiny-mlp")
    p = plan(spec, 1, "metis")
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 1, 1)
    values = torch.zeros(layout.total)
    rule = make_rule(Optimizer("sgd", 0.1), values)
    setup = ShardSetup(layout, 0, 1, 5, lambda r, w: 0)
    server = ShardServer(setup, ShardState(values, None), Downpour(), rule, group=_Nobody())
    config = TrainConfig.of(replicas=1, checkpoint_every=1)
    checkpoints = Checkpoints(server, tmp_path, {"model": "tiny-mlp"}, config, rank=5)
    sidecar = tmp_path / "shard_0.json"
    _push(server, 1)
    assert _until(lambda: sidecar.exists() and json.loads(sidecar.read_text())["updates"] == 1)
    _push(server, 2)
    assert _until(lambda: server.fatal is not None)
    assert "No space left on device" in server.fatal
    assert "No space left on device" in checkpoints.close(final={})
    assert json.loads(sidecar.read_text())["updates"] == 1  # the last good checkpoint stays
    with zipfile.ZipFile(tmp_path / "shard_0.pt") as zf:
        assert zf.testzip() is None
