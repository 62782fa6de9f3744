"""Real processes over torch.distributed (gloo): few tests, each bounded, none leaves a process."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from netpart.cli import main
from netpart.models import ZOO, build_reference, load_spec
from netpart.partition import plan
from netpart.runtime import WorkerFailure, run_step
from netpart.runtime.check import make_batch
from netpart.runtime.step import StepOptions
from tests.conftest import count_processes

pytestmark = pytest.mark.timeout(180)

CONV_MSE = """
name = "conv-mse"
input = { channels = 2, height = 9, width = 9 }
[[layer]]
kind = "conv"
channels = 3
kernel = 3
padding = 1
activation = "tanh"
[[layer]]
kind = "pool"
mode = "avg"
kernel = 3
stride = 2
padding = 1
[[layer]]
kind = "lcn"
kernel = 3
[[layer]]
kind = "local"
channels = 2
kernel = 2
activation = "sigmoid"
[[layer]]
kind = "dense"
units = 3
activation = "none"
"""


def workers_alive() -> int:
    """Step workers of this session still running (not this process's kept zygote, which
    waits for the next job and ends with it)."""
    return count_processes(b"netpart.runtime.step")


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    assert workers_alive() == 0


def test_check_command_passes_for_a_custom_spec_in_three_processes(tmp_path):
    spec_file = tmp_path / "conv.toml"
    spec_file.write_text(CONV_MSE)
    res = subprocess.run(
        [
            sys.executable,
            *"-m netpart check --model".split(),
            str(spec_file),
            *"--workers 3 --method random --batch 3 --stats".split(),
            str(tmp_path / "stats.json"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: all within 1e-09; bytes equal the plan" in res.stdout
    assert "grad layers.0.weight" in res.stdout  # the tied conv kernel, summed over workers
    assert (tmp_path / "stats.json").exists()
    assert load_spec(spec_file).loss == "mse"


def test_run_step_matches_the_reference_and_the_plan():
    spec = ZOO["tiny-local"]
    p = plan(spec, 2, "tiles")
    x, y = make_batch(spec, 3, 5)
    result = run_step(spec, p, x, y, StepOptions(timeout=60))
    model = build_reference(spec, 0, torch.float64)
    loss = model.loss(model(x), y)
    loss.backward()
    assert abs(result.loss - loss.item()) < 1e-12
    for name, prm in model.named_parameters():
        assert torch.allclose(result.grads[name], prm.grad, atol=1e-12, rtol=1e-9)
    sent = sum(v for s in result.sent for (_, phase), v in s.items() if phase == "forward")
    assert sent == p.metrics.volume * 3 * 8


@pytest.mark.parametrize("fault", ["die:1", "hang:2"])
def test_a_dead_or_stuck_worker_stops_everyone_within_the_timeout(monkeypatch, fault):
    spec = ZOO["tiny-local"]
    p = plan(spec, 3)
    x, y = make_batch(spec, 2, 0)
    monkeypatch.setenv("NETPART_TEST_FAULT", fault)
    timeout = 4.0
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        run_step(spec, p, x, y, StepOptions(timeout=timeout))
    elapsed = time.monotonic() - start
    kind, victim = fault.split(":")
    message = str(err.value)
    cause = "exited with code 17" if kind == "die" else "was killed after the timeout"
    assert message.startswith(f"worker {victim} {cause}")  # the cause comes first
    assert re.search(rf"(to|from) worker {victim} failed", message)  # survivors name it
    assert elapsed < 2 * timeout + 15  # survivors give up after `timeout`, the rest are killed
    assert "\n" not in str(err.value)


def test_check_refuses_bad_input_without_starting_processes(tmp_path, capsys):
    assert (
        main(["plan", "--model", "tiny-mlp", "--workers", "2", "--out", str(tmp_path / "p")]) == 0
    )
    capsys.readouterr()
    cases = [
        (
            ["--model", "tiny-local", "--workers", "2", "--plan", str(tmp_path / "p")],
            "is for model 'tiny-mlp'",
        ),
        (
            ["--model", "tiny-mlp", "--workers", "3", "--plan", str(tmp_path / "p")],
            "the plan is for 2 workers, not --workers 3",
        ),
        (
            ["--model", "tiny-mlp", "--workers", "2", "--plan", str(tmp_path / "nope")],
            "no such plan file",
        ),
        (["--model", "image-1.7b", "--workers", "2"], "GiB are available"),
    ]
    for argv, message in cases:
        assert main(["check", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert workers_alive() == 0
    assert os.environ.get("NETPART_TEST_FAULT") is None


def test_check_under_torchrun_uses_its_environment(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc-per-node 2 -m".split(),
            *"netpart check --model tiny-local --workers 2 --method tiles".split(),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count("OK: all within 1e-09; bytes equal the plan") == 1  # rank 0 only


def test_run_times_steps_and_reports_bytes_equal_to_the_plan(tmp_path, capsys):
    stats = tmp_path / "run.json"
    argv = ["run", "--model", "tiny-mlp", "--workers", "2", "--steps", "3", "--batch", "8"]
    assert main([*argv, "--stats", str(stats)]) == 0
    out = capsys.readouterr().out
    assert "tiny-mlp on 2 worker processes" in out and "predicted" in out
    moved = int(out.split("bytes moved per step: ")[1].split(" ")[0].replace(",", ""))
    planned = int(out.split("(plan: ")[1].split(")")[0].replace(",", ""))
    assert moved == planned > 0
    data = json.loads(stats.read_text())
    assert len(data["step_s"]) == 3 and data["step_s_median"] > 0


LAUNCH_AND_HANG = """
import os
from netpart.models import ZOO
from netpart.partition import plan
from netpart.runtime import StepOptions, run_step
from netpart.runtime.check import make_batch
os.environ["NETPART_TEST_FAULT"] = "hang:1"
spec = ZOO["tiny-local"]
x, y = make_batch(spec, 2, 0)
run_step(spec, plan(spec, 3), x, y, StepOptions(timeout=120))
"""


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_killing_the_launcher_takes_its_workers_with_it(signal_name, tmp_path):
    """No worker outlives its launcher; after SIGTERM its temporary files are gone too (after
    SIGKILL nothing can remove them: they go to this test's own directory)."""
    import signal

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-c", LAUNCH_AND_HANG], env=env)
    try:
        deadline = time.monotonic() + 60
        while workers_alive() < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers_alive() == 4  # the preloaded interpreter and the three it forked
        parent.send_signal(getattr(signal, signal_name))
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while workers_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert workers_alive() == 0
    if signal_name == "SIGTERM":
        assert not list(tmp_path.glob("netpart-*"))
