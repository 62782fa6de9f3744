"""A DDP replica's step as calibration times it: the reference module's forward, backward and
update on one thread, each model's median of at most REPLICA_RUNS runs, in the profile's
`ps.replica` schema."""

import torch

from netpart.calibrate import ddp_step
from netpart.cost.exchange import PsExchange
from netpart.models import load_spec


def test_a_replica_step_runs_the_reference_module_and_its_update_on_one_thread(monkeypatch):
    torch.set_num_threads(2)
    steps = []
    real = torch.optim.Adagrad.step

    def counted(self, *args, **kwargs):
        steps.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adagrad, "step", counted)
    seconds, cpu = ddp_step.replica_step(load_spec("tiny-mlp"), 8, 5, 0.0)
    assert seconds > 0 and cpu > 0
    # the first step sizes the run: then warm-up steps (at least 3) and 5 timed ones
    assert len(steps) >= 1 + 3 + 5 and set(steps) == {1}
    assert torch.get_num_threads() == 2  # left as it was


def test_each_model_s_median_of_at_most_three_runs_in_the_profile_s_schema(monkeypatch):
    times = iter([(0.3, 0.1), (0.1, 0.2), (0.2, 0.3), (1e-3, 1e-3), (3e-3, 3e-3), (2e-3, 2e-3)])
    monkeypatch.setattr(ddp_step, "replica_step", lambda spec, batch, steps, seconds: next(times))
    said = []
    specs = [load_spec("bench-local"), load_spec("tiny-mlp")]
    got = ddp_step.replica_steps(specs, batch=32, steps=15, seconds=0.3, runs=5, say=said.append)
    assert got == {
        "batch": 32,
        "seconds": {"bench-local": 0.2, "tiny-mlp": 2e-3},
        "cpu_s": {"bench-local": 0.2, "tiny-mlp": 2e-3},
    }
    assert len(said) == 2 and "bench-local" in said[0] and "200.00 ms" in said[0]
    sizes = [1e3, 1e4]
    tables = {m: {"1": [1e-3, 2e-3]} for m in ("sync", "downpour")}
    ps = PsExchange.from_dict({"sizes": sizes, "seconds": tables, "busy": tables, "replica": got})
    assert ps.replica_s("bench-local") == 0.2 and ps.replica_batch == 32
