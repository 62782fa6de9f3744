"""Training a user's residual network with batch norm (issue 79): synchronous SGD over 2
workers x 2 replicas equals one process's SGD over the replicas' batches, each normalised
alone, with replica 0's running statistics; a resumed run equals the uninterrupted one; the
model.pt loads strictly into the user's class and gives the reference's eval-mode logits."""

import copy

import pytest
import torch

from netpart.data import load_data
from netpart.models import build_reference, load_spec
from netpart.partition import plan
from netpart.train import train
from netpart.train.config import TrainConfig
from tests.models.user_models import NormedSkip
from tests.train.test_training import (
    no_orphans,  # noqa: F401 - no process outlives a test
    sync_config,
)

TARGET = "tests.models.user_models:NormedSkip"
SPEC = load_spec(TARGET, input="3x8x8")


def _sync(steps: int) -> TrainConfig:
    return sync_config(steps, shards=2, checkpoint_every=2)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("graph") / "run"
    p = plan(SPEC, 2, "metis")
    train(SPEC, p, _sync(4), run)
    return p, run


def test_sync_equals_one_process_over_each_replica_s_batch_with_replica_0_s_statistics(straight):
    _, run = straight
    got = torch.load(run / "model.pt", weights_only=True)  # the user's names
    names = {**SPEC.state_names(), **SPEC.buffer_names()}
    ref = build_reference(SPEC, 0, torch.float64)
    other = copy.deepcopy(ref)  # replica 1: its own batch statistics, its running ones unkept
    data = load_data("synthetic", SPEC, 0, TrainConfig().data.examples)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for t in range(1, 5):
        other.load_state_dict(ref.state_dict())
        opt.zero_grad()
        x0, y0 = data.batch(0, 2, t, 8, torch.float64)
        x1, y1 = data.batch(1, 2, t, 8, torch.float64)
        (ref.loss(ref(x0), y0) / 2).backward()
        (other.loss(other(x1), y1) / 2).backward()
        for p, q in zip(ref.parameters(), other.parameters(), strict=True):
            p.grad += q.grad
            q.grad = None
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[names[k]].double(), v.double(), rtol=0, atol=1e-12), k


def test_a_resumed_run_equals_the_uninterrupted_one_buffers_included(straight, tmp_path):
    p, run_straight = straight
    run = tmp_path / "run"
    train(SPEC, p, _sync(2), run)
    train(SPEC, p, _sync(4), run, resume=True)
    got = torch.load(run / "model.pt", weights_only=True)
    want = torch.load(run_straight / "model.pt", weights_only=True)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_the_model_loads_strictly_into_the_user_s_class_and_evaluates_as_the_reference(straight):
    _, run = straight
    saved = torch.load(run / "model.pt", weights_only=True)
    user = NormedSkip().double()
    user.load_state_dict(saved, strict=True)
    assert int(saved["bn0.num_batches_tracked"]) == 4
    names = {**SPEC.state_names(), **SPEC.buffer_names()}
    ref = build_reference(SPEC, 0, torch.float64)
    ref.load_state_dict({k: saved[names[k]] for k in ref.state_dict()})
    user.eval(), ref.eval()
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    assert torch.equal(user(x), ref(x))
