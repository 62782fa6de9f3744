import pytest

import netpart.train.fit as fit
from netpart.cli import main
from netpart.errors import TrainError
from netpart.models import load_spec
from netpart.partition import plan
from netpart.train.config import TrainConfig


def test_the_estimate_grows_with_replicas_and_precision():
    spec = load_spec("digits-mlp")
    p = plan(spec, 2, "metis")
    one = fit.estimate(spec, p, TrainConfig(replicas=1, shards=2))
    two = fit.estimate(spec, p, TrainConfig(replicas=2, shards=2))
    wide = fit.estimate(spec, p, TrainConfig(replicas=2, shards=2, dtype="float64"))
    assert two.workers_bytes == 2 * one.workers_bytes and two.processes == one.processes + 2
    assert wide.total > two.total > one.total > 0
    params = sum(w.params for w in p.per_worker)
    assert one.workers_bytes >= 4 * params * 4  # values, gradients, fetched copy, buffers


def test_a_job_that_cannot_fit_is_refused_with_its_figures(monkeypatch):
    spec = load_spec("digits-mlp")
    p = plan(spec, 2, "metis")
    config = TrainConfig(replicas=2, shards=2)
    need = fit.estimate(spec, p, config).total
    monkeypatch.setattr(fit, "available_memory", lambda: need + 1)
    fit.check_fits(spec, p, config)
    monkeypatch.setattr(fit, "available_memory", lambda: need - 1)
    with pytest.raises(TrainError, match=r"needs about .* GiB on this machine \(6 processes"):
        fit.check_fits(spec, p, config)


def test_thousands_of_processes_are_refused_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fit, "available_memory", lambda: 8 * 2**30)
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-local", "--workers", "1000", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3,000 processes need at least" in err[0], err
    assert not out.exists()  # nothing written, nothing started
