"""Sandblaster L-BFGS in real processes: a coordinator, shard-side vectors, work units."""

import json
import time

import pytest
import torch

from netpart.data import load_data
from netpart.models import load_spec
from netpart.partition import plan
from netpart.train import train
from netpart.train.config import TrainConfig
from tests.conftest import count_processes, torch_lbfgs

pytestmark = pytest.mark.timeout(240)

SPEC = load_spec("tiny-local")


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 5
    alive = lambda: count_processes(b"netpart.train.process")  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == 0, "a training process outlived its test"


def test_distributed_sandblaster_equals_torch_lbfgs_and_sends_only_scalars(tmp_path):
    data = load_data("digits", SPEC)
    cfg = TrainConfig(
        replicas=1, shards=2, mode="sandblaster", optimizer="lbfgs", lr=1.0, steps=6,
        batch=data.n, units=4, history=10, line_search="none", data="digits",
        dtype="float64", timeout=60,
    )  # fmt: skip
    train(SPEC, plan(SPEC, 2, "metis"), cfg, tmp_path / "run")
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)

    x, y = torch.from_numpy(data.x).double(), torch.from_numpy(data.y)
    ref, _ = torch_lbfgs(SPEC, x, y, lr=1.0, iterations=6, history=10)
    for name, p in ref.state_dict().items():
        assert torch.allclose(ours[name], p, rtol=1e-8, atol=1e-10), name
    stats = json.loads((tmp_path / "run" / "coordinator.json").read_text())
    assert stats["iterations"] == 6 and stats["losses"][-1] < 0.5 * stats["losses"][0]
    # Every message the coordinator received from a shard held one value (7-int header + 1).
    assert stats["coordinator_bytes_in"] == 64 * stats["coordinator_scalars"]
    params = sum(p.numel() for p in ref.parameters())
    assert stats["coordinator_bytes_in"] < 8 * params  # less than one vector, over the run


def test_a_slow_replica_gets_fewer_units_and_backups_finish_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("NETPART_TEST_FAULT", "slow:1@0.4")  # rank 1 = replica 1: 0.4 s a unit
    cfg = TrainConfig(
        replicas=2, shards=1, mode="sandblaster", optimizer="lbfgs", lr=1.0, steps=2,
        batch=256, units=8, data="digits", timeout=60,
    )  # fmt: skip
    train(SPEC, plan(SPEC, 1, "metis"), cfg, tmp_path / "run")
    stats = json.loads((tmp_path / "run" / "coordinator.json").read_text())
    fast, slow = stats["units_by_replica"]
    assert fast + slow == 8 * stats["evaluations"] and fast > 3 * slow
    assert stats["backups_won"] >= 1  # a backup copy finished a unit the slow replica held
