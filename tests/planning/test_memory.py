import os

import pytest

import netpart.planning.memory as fit
import netpart.train.job
from netpart.cli import main
from netpart.errors import TrainError
from netpart.models import load_spec
from netpart.partition import plan
from netpart.train.config import TrainConfig


def test_the_estimate_grows_with_replicas_and_precision():
    spec = load_spec("digits-mlp")
    p = plan(spec, 2, "metis")
    one = fit.estimate(spec, p, **TrainConfig.of(replicas=1, shards=2).memory_job(p.workers))
    two = fit.estimate(spec, p, **TrainConfig.of(replicas=2, shards=2).memory_job(p.workers))
    wide = fit.estimate(
        spec, p, **TrainConfig.of(replicas=2, shards=2, dtype="float64").memory_job(p.workers)
    )
    assert two.workers_bytes == 2 * one.workers_bytes and two.processes == one.processes + 2
    assert wide.total > two.total > one.total > 0
    params = sum(w.params for w in p.per_worker)
    assert one.workers_bytes >= 4 * params * 4  # values, gradients, fetched copy, buffers


def test_a_job_that_cannot_fit_is_refused_with_its_figures():
    spec = load_spec("digits-mlp")
    p = plan(spec, 2, "metis")
    config = TrainConfig.of(replicas=2, shards=2)
    need = fit.estimate(spec, p, **config.memory_job(p.workers)).total
    fit.check_fits(spec, p, available=need + 1, **config.memory_job(p.workers))
    with pytest.raises(TrainError, match=r"needs about .* GiB on this machine \(6 processes"):
        fit.check_fits(spec, p, available=need - 1, **config.memory_job(p.workers))


def test_thousands_of_processes_are_refused_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(netpart.train.job, "available_memory", lambda: 8 * 2**30)
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-local", "--workers", "1000", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3,000 processes need at least" in err[0], err
    assert not out.exists()  # nothing written, nothing started


@pytest.mark.alone  # proportional set sizes: other jobs' torch processes share its pages
@pytest.mark.timeout(180)
def test_the_estimate_is_within_1_5x_of_a_real_job_s_peak(tmp_path):
    """A job's processes measured from outside (their proportional set sizes, sampled while
    it runs) against the estimate `netpart train` checks: neither above 1.5x the other
    (benchmarks/memory_bench.py measures more models and batches)."""
    import os
    import subprocess
    import sys
    import threading
    import time
    import uuid

    from netpart.processes.liveness import job_pss

    marker = uuid.uuid4().hex
    argv = [
        sys.executable,
        *"-m netpart train --model tiny-local --workers 2 --replicas 2".split(),
        *"--ps-shards 2 --steps 6 --batch 512 --out".split(),
        str(tmp_path / "run"),
    ]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "NETPART_FIT_TEST": marker},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], job_pss(f"NETPART_FIT_TEST={marker}".encode()))
            time.sleep(0.02)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.join()
    assert proc.returncode == 0, err.decode()[-500:]
    spec = load_spec("tiny-local")
    p = plan(spec, 2)
    est = fit.estimate(spec, p, **TrainConfig.of(replicas=2, shards=2, batch=512).memory_job(2))
    assert peak[0] / 1.5 <= est.total <= peak[0] * 1.5, (est.total, peak[0])


def test_a_job_far_beyond_the_machine_s_cores_is_refused_unless_forced(
    tmp_path, capsys, monkeypatch
):
    """Issue 80, item 2: `train --workers 16 --replicas 2` started 48 processes on 2 cores
    without a word."""
    fit.check_crowding(16, "x", cores=2, force=False)  # 8 a core: allowed
    fit.check_crowding(33, "x", cores=2, force=True)  # forced
    with pytest.raises(TrainError, match="x: 17 processes on this machine's 2 cores, about"):
        fit.check_crowding(17, "x", cores=2, force=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-local", "--workers", "16", "--replicas", "2"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "48 processes on this machine's 2 cores" in err[0], err
    assert "more than 8 a core is refused" in err[0] and "--force" in err[0]
    assert not out.exists()
    assert main(["check", "--model", "tiny-local", "--workers", "17"]) == 2
    assert "17 processes on this machine's 2 cores" in capsys.readouterr().err
