"""A newcomer's first hour: what they type works as a PyTorch user expects, or says in one
line what to do instead (exit 2, nothing written)."""

import os

import numpy as np
import pytest

from netpart.cli import main
from netpart.errors import PlanError
from netpart.models import ZOO
from netpart.partition import plan
from netpart.partition.blocks import Granularity
from netpart.partition.graph import graph_size
from netpart.partition.planner import check_size


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    return err


def test_more_workers_than_the_widest_layer_has_blocks_is_one_line_before_metis(capsys):
    code, out, err = run(capsys, "plan", "--model", "tiny-local", "--workers", "100000")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "at most 1568 workers" in err and "0:local" in err


def test_a_plan_that_would_not_fit_in_memory_is_refused_before_the_graph_is_built():
    spec = ZOO["image-1.7b"]
    size = graph_size(spec, Granularity.for_workers(512))
    assert size.edges == 82_031_717 and size.blocks == 94_719  # counted, not built
    with pytest.raises(PlanError, match=r"needs about .* GiB .* available"):
        check_size(spec, 512, Granularity.for_workers(512), memory=2**30)


def test_metis_never_prints(capfd):
    """METIS writes to C's stdout; none of it reaches the user (it goes to the debug log)."""
    plan(ZOO["tiny-local"], 64, "metis")
    plan(ZOO["tiny-mlp"], 200, "metis")  # more parts than vertices: METIS complains
    out, err = capfd.readouterr()
    assert "***" not in out + err and out == "" and err == ""


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["tran"], "did you mean 'train'?"),
        (["train", "--model", "tiny-local", "--wokers", "2"], "did you mean '--workers'?"),
        (["plan", "--model", "tiny-local", "--worker", "2"], "unrecognized arguments: --worker"),
        (["plan", "--model", "tiny-local", "--workers", "0"], "must be >= 1"),
        (["plan", "--model", "tiny-local", "--workers", "2", "--method", "metsi"], "'metis'?"),
    ],
)
def test_argument_errors_are_one_line_from_the_subcommand_with_a_suggestion(capsys, argv, expect):
    err = usage_error(capsys, *argv)
    assert expect in err and "see `netpart" in err
    if len(argv) > 1:
        assert err.startswith(f"netpart {argv[0]}: error:")


def test_a_misspelt_model_gets_a_did_you_mean(capsys):
    code, _, err = run(capsys, "plan", "--model", "tiny-locl", "--workers", "2")
    assert code == 2 and "did you mean 'tiny-local'?" in err


def test_every_option_s_default_is_in_the_help(capsys):
    for command in ("plan", "run", "train", "eval", "export", "graph", "calibrate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "%%" not in text
        if command == "plan":
            assert "print only, write nothing" in text  # --out
        if command == "train":
            assert "out/train" in text and "(default 0)" in text  # --out, --seed
        if command == "graph":
            assert "GraphML" in text


def test_verbose_is_netpart_s_debug_log_only(capsys):
    import logging

    assert main(["-v", "models"]) == 0
    assert logging.getLogger("netpart").level == logging.DEBUG
    assert logging.getLogger().level == logging.WARNING  # PIL, matplotlib stay quiet
    logging.getLogger("netpart").setLevel(logging.NOTSET)


def test_channels_last_arrays_are_refused_or_transposed_as_asked(tmp_path):
    from netpart.data import DataError, load_data

    spec = ZOO["bench-local"]  # 3 x 48 x 48
    rng = np.random.default_rng(0)
    nchw = rng.standard_normal((10, 3, 48, 48)).astype(np.float32)
    y = rng.integers(0, 10, 10)
    np.savez(tmp_path / "nhwc.npz", x=nchw.transpose(0, 2, 3, 1), y=y)
    np.savez(tmp_path / "nchw.npz", x=nchw, y=y)
    with pytest.raises(DataError, match=r"channels last.*--layout nhwc"):
        load_data(str(tmp_path / "nhwc.npz"), spec)
    moved = load_data(str(tmp_path / "nhwc.npz"), spec, layout="nhwc")
    plain = load_data(str(tmp_path / "nchw.npz"), spec)
    assert np.array_equal(moved.x, plain.x) and np.array_equal(moved.held_out[0], plain.held_out[0])
    with pytest.raises(DataError, match="--layout nhwc needs"):
        load_data(str(tmp_path / "nchw.npz"), spec, layout="nhwc")


def test_tensorboard_without_its_package_is_one_line_before_anything_runs(
    tmp_path, capsys, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-local", "--workers", "2", "--log", "csv,tensorboard"]
    code, _, err = run(capsys, *argv, "--out", str(out))
    assert code == 2 and "pip install tensorboard" in err and err.count("\n") == 1
    assert not out.exists()
    code, _, err = run(capsys, *argv[:-1], "csv,wandb", "--out", str(out))
    assert code == 2 and "--log wandb: choose from csv, tensorboard" in err


def test_progress_lines_count_steps_per_replica_label_bytes_and_wait_for_an_eta(capsys):
    """Issue 80, item 6: '--steps 500' with 2 replicas read 'steps 1000/1000', the bytes
    moved read as an unlabelled (leaking) 'MB', and the first ETA was start-up's."""
    from netpart.train.launch import ProgressLines

    now = [0.0]
    lines = ProgressLines(0, say=print, clock=lambda: now[0])
    stats = {"loss": 1.0, "samples_s": 10.0, "step_ms": 5.0, "mb": 2289.4, "replicas": 2}
    for done in (2, 100, 1000):
        now[0] += 10
        lines(done, stats, 1000)
    first, second, last = capsys.readouterr().out.splitlines()
    assert first.startswith("replica steps 1/500: ") and "ETA" not in first
    assert "2,289 MB moved" in first
    assert second.startswith("replica steps 50/500: ") and second.endswith("ETA 180 s")
    assert last.startswith("replica steps 500/500: ") and "ETA" not in last


def _chain(layers: int, units: int = 8):
    from netpart.models import ModelSpec

    dense = [{"kind": "dense", "units": units} for _ in range(layers)]
    return ModelSpec.from_dict({"name": "chain", "input": {"features": 8}, "layer": dense})


def test_plan_checks_a_layer_s_units_and_metis_s_constraints_before_it_builds(monkeypatch):
    """Issue 80, item 12: one layer of 1e9 units, or an image of 3x20000x20000, grew until
    the OOM killer; a chain of 10,000 layers ran 9 minutes in METIS's 10,000 constraints."""
    import netpart.partition.planner as planner
    from netpart.models import ModelSpec

    wide = ModelSpec.from_dict(
        {"name": "wide", "input": {"features": 10}, "layer": [{"kind": "dense", "units": 10**9}]}
    )
    with pytest.raises(PlanError, match=r"1,000,000,010 units in its largest layer"):
        check_size(wide, 2, Granularity.for_workers(2), memory=16 * 2**30)
    monkeypatch.setattr(planner, "METIS_MOST_WEIGHTS", 10_000)  # a 40-layer chain is over it
    chain = _chain(40)
    with pytest.raises(PlanError, match="--method metis: 40 balance constraints"):
        plan(chain, 2, "metis")
    p = plan(chain, 2)
    assert p.method == "stripe" and [c.method for c in p.candidates] == ["stripe"]


def test_a_plan_of_slices_too_small_to_mean_much_says_so(capsys):
    """Issue 80, item 2: `plan --workers 1000` on a small CNN predicted 4.0 ms, no warning."""
    code, out, err = run(capsys, "plan", "--model", "tiny-local", "--workers", "64")
    assert code == 0 and out
    assert "64 workers own about 24 units each of tiny-local's widest layer" in err
    code, _, err = run(capsys, "plan", "--model", "tiny-local", "--workers", "4")
    assert code == 0 and "warning" not in err


def test_progress_says_the_memory_the_job_s_processes_hold_counting_shared_pages_once():
    """Issue 80, item 6: the job's memory in the progress line. Pages a zygote's children
    share count once (proportional set sizes), a process that has ended counts nothing."""
    import subprocess
    import sys

    from netpart.processes.memory import processes_memory
    from netpart.train.launch import postfix
    from netpart.train.supervise import JobMemory

    mine = processes_memory([os.getpid()])
    assert 10e6 < mine < 64e9  # this test's interpreter, torch imported
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert processes_memory([int(gone.stdout)]) == 0

    class Running:  # what JobMemory reads of a job's process
        pid = os.getpid()

        def poll(self):
            return None

    job = type("Job", (), {})()
    job.procs = [Running()]
    done, stats = JobMemory(job)(3, {"loss": 1.0, "samples_s": 1.0, "step_ms": 1.0, "mb": 1.0})
    assert done == 3 and stats["memory_mb"] == pytest.approx(mine / 1e6, rel=0.5)
    assert postfix(stats).endswith(f", memory {stats['memory_mb']:,.0f} MB")
    assert "memory" not in postfix({**stats, "memory_mb": 0})  # torchrun: not known
