"""Sandblaster's L-BFGS core: shard-held vectors, a driver that only sees scalars."""

import itertools

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from netpart.models import build_reference, load_spec
from netpart.ps.lbfgs_vectors import ShardVectors
from netpart.runtime.check import make_batch
from netpart.train.lbfgs_driver import LBFGSDriver, LocalShards
from tests.conftest import torch_lbfgs


def _problem(name: str, shards: int, history: int, seed: int = 0):
    """A reference model in float64, its batch, and S shards holding uneven slices of x."""
    spec = load_spec(name)
    model = build_reference(spec, seed, torch.float64)
    x, y = make_batch(spec, 48, seed)
    flat = parameters_to_vector(model.parameters()).detach().clone()
    cuts = torch.linspace(0, flat.numel(), shards + 1).round().long().tolist()
    cuts[1] = cuts[1] // 2 + 1  # uneven on purpose
    parts = [flat[a:b].clone() for a, b in itertools.pairwise(cuts)]
    sh = LocalShards([ShardVectors(p, history) for p in parts])

    def evaluate() -> float:
        vector_to_parameters(torch.cat([s.vectors["x"] for s in sh.shards]), model.parameters())
        model.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        for s, (a, b) in zip(sh.shards, itertools.pairwise(cuts), strict=True):
            s.vectors["g"].copy_(g[a:b])
        return float(loss.detach())

    return spec, model, (x, y), sh, evaluate


@pytest.mark.parametrize(("name", "history", "lr"), [("tiny-mlp", 5, 1.0), ("tiny-local", 3, 0.5)])
def test_shard_side_lbfgs_equals_torch_lbfgs(name, history, lr):
    spec, _, (x, y), sh, evaluate = _problem(name, shards=3, history=history)
    result = LBFGSDriver(sh, evaluate, lr=lr, history=history).run(max_iter=12)
    ours = torch.cat([s.vectors["x"] for s in sh.shards])

    ref, opt = torch_lbfgs(spec, x, y, lr, 12, history)
    theirs = parameters_to_vector(ref.parameters()).detach()
    assert result.iterations == opt.state[next(iter(ref.parameters()))]["n_iter"]
    assert torch.allclose(ours, theirs, rtol=1e-9, atol=1e-11)
    assert result.losses[-1] < 0.5 * result.losses[0]


def test_the_driver_receives_scalars_whatever_the_model_size():
    counts = {}
    for name in ("tiny-mlp", "tiny-local"):  # 2,410 and 32,290 parameters
        _, _, _, sh, evaluate = _problem(name, shards=3, history=4)
        result = LBFGSDriver(sh, evaluate, lr=0.5, history=4, tolerance_change=0).run(8)
        counts[name] = (sh.scalars, result.iterations)
    assert counts["tiny-mlp"] == counts["tiny-local"]  # the same reductions, one scalar each
    assert counts["tiny-mlp"][0] < 400  # against thousands of parameters


def test_armijo_backtracks_where_a_fixed_step_overshoots():
    _, _, _, sh, evaluate = _problem("tiny-mlp", shards=2, history=5)
    fixed = LBFGSDriver(sh, evaluate, lr=8.0, history=5).run(10)
    _, _, _, sh, evaluate = _problem("tiny-mlp", shards=2, history=5)
    armijo = LBFGSDriver(sh, evaluate, lr=8.0, history=5, line_search="armijo").run(10)
    assert any(b > a for a, b in zip(fixed.losses, fixed.losses[1:], strict=False))
    assert armijo.backtracks > 0
    assert all(b <= a for a, b in zip(armijo.losses, armijo.losses[1:], strict=False))
    assert armijo.losses[-1] < fixed.losses[-1]
