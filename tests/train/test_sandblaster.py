"""Sandblaster L-BFGS in real processes: a coordinator, shard-side vectors, work units."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from netpart.data import load_data
from netpart.errors import TrainError
from netpart.models import load_spec
from netpart.partition import plan
from netpart.train import train
from netpart.train.config import TrainConfig
from tests.conftest import count_processes, torch_lbfgs, wait_for_lines

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


def exact_lbfgs(replicas: int, steps: int, units: int, timeout: float) -> TrainConfig:
    """Full-batch L-BFGS on digits in float64 with torch's fixed step, on 2 shards."""
    return TrainConfig.of(
        replicas=replicas,
        shards=2,
        mode="sandblaster",
        optimizer="lbfgs",
        lr=1.0,
        steps=steps,
        batch=load_data("digits", SPEC).n,
        units=units,
        history=10,
        line_search="none",
        data="digits",
        dtype="float64",
        timeout=timeout,
    )


def assert_equals_torch_lbfgs(run, iterations: int):
    """The run's model equals torch.optim.LBFGS's on the whole batch; returns torch's."""
    data = load_data("digits", SPEC)
    ours = torch.load(run / "model.pt", weights_only=True)
    x, y = torch.from_numpy(data.x).double(), torch.from_numpy(data.y)
    ref, _ = torch_lbfgs(SPEC, x, y, lr=1.0, iterations=iterations, history=10)
    for name, p in ref.state_dict().items():
        assert torch.allclose(ours[name], p, rtol=1e-8, atol=1e-10), name
    return ref


def test_distributed_sandblaster_equals_torch_lbfgs_and_sends_only_scalars(tmp_path):
    cfg = exact_lbfgs(replicas=1, steps=6, units=4, timeout=60)
    train(SPEC, plan(SPEC, 2, "metis"), cfg, tmp_path / "run")
    ref = assert_equals_torch_lbfgs(tmp_path / "run", iterations=6)
    stats = json.loads((tmp_path / "run" / "coordinator.json").read_text())
    assert stats["iterations"] == 6 and stats["losses"][-1] < 0.5 * stats["losses"][0]
    # Every message the coordinator received from a shard held one value (7-int header + 1).
    assert stats["coordinator_bytes_in"] == 64 * stats["coordinator_scalars"]
    params = sum(p.numel() for p in ref.parameters())
    assert stats["coordinator_bytes_in"] < 8 * params  # less than one vector, over the run


def test_a_slow_replica_gets_fewer_units_and_backups_finish_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("NETPART_TEST_FAULT", "slow:1@0.4")  # rank 1 = replica 1: 0.4 s a unit
    cfg = TrainConfig.of(
        replicas=2,
        shards=1,
        mode="sandblaster",
        optimizer="lbfgs",
        lr=1.0,
        steps=2,
        batch=256,
        units=8,
        data="digits",
        timeout=60,
    )
    train(SPEC, plan(SPEC, 1, "metis"), cfg, tmp_path / "run")
    stats = json.loads((tmp_path / "run" / "coordinator.json").read_text())
    fast, slow = stats["units_by_replica"]
    assert fast + slow == 8 * stats["evaluations"] and fast > 3 * slow
    assert stats["backups_won"] >= 1  # a backup copy finished a unit the slow replica held


@pytest.mark.parametrize(
    "workers,fault",
    [(1, "die:1@3"), (2, "die:3@2")],  # replica 1's only worker; replica 1's worker 1
    ids=["worker-0-dies", "worker-1-dies"],
)
def test_a_replica_lost_inside_a_unit_has_its_unit_reissued(tmp_path, monkeypatch, workers, fault):
    """The run finishes with the other replica and its result is exact: every unit's
    gradient still reaches the shards once (torch.optim.LBFGS on the whole batch)."""
    monkeypatch.setenv("NETPART_TEST_FAULT", fault)
    cfg = exact_lbfgs(replicas=2, steps=4, units=8, timeout=3)
    t0 = time.monotonic()
    summary = train(SPEC, plan(SPEC, workers, "metis"), cfg, tmp_path / "run")
    assert time.monotonic() - t0 < 60 and list(summary.lost) == [1]
    stats = json.loads((tmp_path / "run" / "coordinator.json").read_text())
    assert stats["iterations"] == 4 and stats["lost_replicas"] == [1]
    assert_equals_torch_lbfgs(tmp_path / "run", iterations=4)


def test_sigint_stops_sandblaster_at_an_iteration_with_a_final_checkpoint(tmp_path):
    run = tmp_path / "run"
    cmd = sandblaster_cmd(run, "--ps-shards", "2", "--steps", "100000", "--timeout", "20")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    (_, err), _ = finish_after(proc, run / "sandblaster.jsonl", signal.SIGINT)
    assert proc.returncode == 130, err.decode()[-2000:]
    stats = json.loads((run / "coordinator.json").read_text())
    assert stats["stopped"] == "signal" and stats["iterations"] < 100000
    assert torch.load(run / "model.pt", weights_only=True)
    for s in range(2):  # the final checkpoint holds the last evaluated point
        assert json.loads((run / f"shard_{s}.json").read_text())["updates"] == stats["evaluations"]


def test_a_second_sigint_kills_a_hung_job_at_once(tmp_path):
    run = tmp_path / "run"
    cmd = sandblaster_cmd(run, "--ps-shards", "1", "--steps", "100", "--timeout", "600")
    env = {**os.environ, "NETPART_TEST_FAULT": "hang:0@20,hang:1@20"}  # in evaluation 3
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    (_, err), elapsed = finish_after(proc, run / "sandblaster.jsonl", signal.SIGINT, twice=True)
    assert proc.returncode == 130 and elapsed < 20, err.decode()[-2000:]
    assert "killed by a second signal" in err.decode().strip().splitlines()[-1]


def sandblaster_cmd(run, *flags):
    """`netpart train` of Sandblaster on tiny-mlp, 2 replicas of 1 worker, into `run`."""
    return [
        sys.executable,
        *"-m netpart train --mode sandblaster --optimizer lbfgs".split(),
        *"--model tiny-mlp --workers 1 --replicas 2 --out".split(),
        str(run),
        *flags,
    ]


def finish_after(proc, lines, sig, twice=False):
    """Send `sig` once `lines` has 2 lines (and, if `twice`, once the replicas reached their
    hang, and again once the launcher said it is stopping); the process's output and the
    seconds it took to end after the first signal."""
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, b"")))
    reader.start()
    try:
        wait_for_lines(lines, 2)
        logs = [lines.parent / "logs" / f"rank{k}.log" for k in (0, 1)]
        if twice:  # the replicas reach their hang (they say so in their logs)
            assert _until(lambda: all(b"hangs at point" in _read(x) for x in logs))
        t0 = time.monotonic()
        proc.send_signal(sig)
        if twice:  # the launcher took the first signal: a second one is not merged into it
            assert _until(lambda: any(b"stopping every process" in line for line in err))
            proc.send_signal(sig)
        proc.wait(timeout=60)  # its output is a few lines: no pipe fills meanwhile
        out = proc.stdout.read()
        reader.join(timeout=60)
        return (out, b"".join(err)), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read(path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _until(condition, timeout: float = 60.0) -> bool:
    """Whether `condition()` came true within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_model_with_dropout_is_refused_before_anything_starts(tmp_path):
    """L-BFGS evaluates one function at many points; dropout makes every evaluation another."""
    layers = tuple(
        dataclasses.replace(layer, dropout=0.5 if i == 0 else None)
        for i, layer in enumerate(SPEC.layers)
    )
    dropped = dataclasses.replace(SPEC, layers=layers)
    cfg = exact_lbfgs(replicas=1, steps=2, units=2, timeout=10)
    with pytest.raises(TrainError, match="layer 0 has dropout, and Sandblaster's L-BFGS"):
        train(dropped, plan(dropped, 1), cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
