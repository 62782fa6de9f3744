"""Issue 78's acceptance on models as a PyTorch user writes them (`user_models.py`): each
imports, plans on 2, 4 and 8 workers, and its split step equals the user's own module under
its own parameter names (float64, 1e-9) at N = 2 in worker processes and N = 3 in threads;
each trains on 2 workers x 2 replicas and its weights load strictly into its class; the
LeNet-5 goes through the README's "your own model" section (plan, train, eval) and its
weights load in a process that never imports netpart, giving the same logits; --init module
starts from the module's own weights."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from netpart.cli import main
from netpart.models import build_reference
from netpart.models.dropout import training_key
from netpart.models.importer import import_model, parse_input
from netpart.partition import plan
from netpart.runtime.check import check_step, compare_with_reference, make_batch
from netpart.runtime.inprocess import run_step_threads

from .plain_lenet import LeNet5
from .user_models import MODELS

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("name", list(MODELS))
def test_a_user_s_model_plans_and_its_split_step_equals_the_module_itself(name):
    make, shape = MODELS[name]
    spec = import_model(make(), parse_input(shape), name)
    for workers in (2, 4, 8):
        assert plan(spec, workers).workers == workers
    report, _ = check_step(spec, plan(spec, 2), batch=4, seed=1, module=make())
    assert report.ok, [d for d in report.differences if not d.ok]
    names = [d.name for d in report.differences]
    user_names = {f"grad {n}" for n, _ in make().named_parameters()}
    assert user_names == set(names) - {"loss", "outputs"}  # every gradient, in its names
    x, y = make_batch(spec, 4, seed=2)
    key = training_key(spec, 2, step=5, first_sample=4)  # the VGG's dropout on, its masks
    result = run_step_threads(spec, plan(spec, 3, "metis"), x, y, seed=2, dropout=key)
    diffs = compare_with_reference(spec, x, y, 2, result, 1e-9, module=make(), dropout=key)
    assert all(d.ok for d in diffs), [d for d in diffs if not d.ok]


def test_the_readme_s_own_model_section_runs_and_the_weights_load_back_without_netpart(
    tmp_path, capsys
):
    """README, "Your own model": plan, train (2 workers x 2 replicas) on that plan, eval;
    the run's model.pt and the exported state_dict load strictly into the user's LeNet-5 in a
    process that never imports netpart and give the logits netpart's reference gives."""
    model = ["--model", f"{HERE / 'plain_lenet.py'}:LeNet5", "--input", "1x28x28"]
    plan_dir, run = tmp_path / "plan", tmp_path / "run"
    assert main(["plan", *model, "--workers", "2", "--out", str(plan_dir)]) == 0
    args = f"--workers 2 --replicas 2 --plan {plan_dir} --steps 8 --batch 8 --out {run}"
    assert main(["train", *model, *args.split()]) == 0
    assert main(["eval", str(run)]) == 0
    out = tmp_path / "lenet.pt"
    assert main(["export", str(run), "--format", "state_dict", "--out", str(out)]) == 0
    assert "your LeNet5's state_dict" in capsys.readouterr().out
    x = torch.linspace(-1, 1, 2 * 28 * 28).reshape(2, 1, 28, 28)
    torch.save(x, tmp_path / "x.pt")
    plain = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(HERE)!r})
        from plain_lenet import LeNet5
        x = torch.load({str(tmp_path / "x.pt")!r})
        logits = []
        for path in ({str(run / "model.pt")!r}, {str(out)!r}):
            net = LeNet5()
            net.load_state_dict(torch.load(path, weights_only=True))  # strict
            logits.append(net(x))
        assert torch.equal(*logits)
        torch.save(logits[0], {str(tmp_path / "y.pt")!r})
        assert not any(m.startswith("netpart") for m in sys.modules)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", plain], check=True, timeout=120, env=env, cwd=tmp_path)
    from netpart.train.rundir import run_model

    job, state = run_model(run)  # the run's model.pt, in the user's names, read back
    reference = build_reference(job.spec)
    reference.load_state_dict(state)
    assert torch.allclose(reference(x), torch.load(tmp_path / "y.pt"), rtol=0, atol=1e-6)


def test_a_module_without_its_input_shape_is_one_line_and_nothing_written(tmp_path, capsys):
    model = f"{HERE / 'plain_lenet.py'}:LeNet5"
    for command, writes in (("plan", "--out"), ("check", "--stats"), ("train", "--out")):
        out = tmp_path / command
        assert main([command, "--model", model, "--workers", "2", writes, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is a module: give one example's shape" in err, err
        assert not out.exists()


def test_init_module_starts_training_from_the_user_s_own_initial_weights(tmp_path, capsys):
    """--init module: the shards start from the weights the user's module is built with
    after torch.manual_seed(--seed); a run of no steps writes exactly them back."""
    model = ["--model", f"{HERE / 'plain_lenet.py'}:LeNet5", "--input", "1x28x28"]
    run = tmp_path / "run"
    args = f"--workers 2 --replicas 1 --steps 0 --seed 7 --init module --out {run}"
    assert main(["train", *model, *args.split()]) == 0
    torch.manual_seed(7)
    want = LeNet5().state_dict()
    got = torch.load(run / "model.pt", weights_only=True)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    zoo = f"--model tiny-mlp --workers 1 --init module --out {tmp_path / 'zoo'}"
    assert main(["train", *zoo.split()]) == 2
    assert "--init module: --model tiny-mlp is not a module" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["VGGish", "distbelief", "MLP", "rectangles"])
def test_each_user_model_trains_and_its_weights_load_strictly_into_its_class(tmp_path, name):
    """The other models train too (2 workers x 2 replicas on generated examples), and
    the run's model.pt loads strictly into the user's class, giving the reference's logits."""
    make, shape = MODELS[name]
    run = tmp_path / "run"
    model = ["--model", f"tests.models.user_models:{name}", "--input", shape]
    args = f"--workers 2 --replicas 2 --steps 4 --batch 8 --out {run}"
    assert main(["train", *model, *args.split()]) == 0
    from netpart.train.rundir import run_model

    job, state = run_model(run)
    reference = build_reference(job.spec)
    reference.load_state_dict(state)
    net = make().eval()  # its dropout off, as the reference evaluates
    net.load_state_dict(torch.load(run / "model.pt", weights_only=True))  # strict
    x = torch.randn(3, *(int(v) for v in shape.split("x")))
    assert torch.allclose(net(x), reference(x), rtol=0, atol=1e-5)
