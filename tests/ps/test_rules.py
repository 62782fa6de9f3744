"""Update rules a shard applies: equal to torch's optimizers."""

import torch

from netpart.ps.rules import Optimizer, make_rule


def test_adagrad_rule_equals_torch_adagrad():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen, dtype=torch.float64)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(5)]
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.Adagrad([ref], lr=0.1)
    rule = make_rule(Optimizer("adagrad", 0.1), start.clone())
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        rule.apply(0, g[:20])  # two segments, as two pushes would
        rule.apply(20, g[20:])
    assert torch.allclose(rule.values, ref.detach(), rtol=0, atol=1e-15)
    assert torch.allclose(rule.state, opt.state[ref]["sum"], rtol=0, atol=1e-15)


def test_sgd_rule():
    rule = make_rule(Optimizer("sgd", 0.5), torch.ones(4))
    rule.apply(1, torch.tensor([2.0, 4.0]))
    assert rule.values.tolist() == [1.0, 0.0, -1.0, 1.0] and rule.state is None
