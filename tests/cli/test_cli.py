import errno
import json
import subprocess
import sys

import numpy as np
import pytest

from netpart.cli import main
from netpart.models import ZOO
from netpart.partition.plans import load_plan


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models_lists_the_zoo(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for name, spec in ZOO.items():
        assert name in out and f"{spec.num_params:,}" in out


def test_plan_writes_files_that_load_back(tmp_path, capsys):
    out_dir = tmp_path / "p"
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "tiny-local",
        "--workers",
        "3",
        "--compare",
        "--ps-shards",
        "2",
        "--out",
        str(out_dir),
    )
    assert code == 0
    assert "tiny-local on 3 workers (" in out and "auto chose" in out and "round-robin" in out
    assert "parameter server: 2 shards" in out
    assert "## Parameter server: 2 shards" in (out_dir / "report.md").read_text()
    names = {p.name for p in out_dir.iterdir()}
    assert {"plan.json", "node_map.npy", "report.md", "load.png", "halo_traffic.png"} <= names
    assert {"partition_map.png", "compare.png"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    plan = load_plan(out_dir, ZOO["tiny-local"])
    data = json.loads((out_dir / "plan.json").read_text())
    for key in ("schema_version", "model", "fingerprint", "method", "options", "seed", "workers"):
        assert key in data
    for key in ("edge_cut", "volume", "lower_bound", "max_layer_imbalance", "predicted_step_s"):
        assert key in data["metrics"]
    assert np.array_equal(np.load(out_dir / "node_map.npy"), plan.node_map)
    weighed = data["auto"]["candidates"]  # the default, auto, records every candidate
    assert {c["method"] for c in weighed} >= {"metis", "metis-aligned", "tiles"}
    assert plan.candidates and data["method"] in {c["method"] for c in weighed}
    report = (out_dir / "report.md").read_text()
    assert "## Methods compared" in report and "![load.png](load.png)" in report
    assert "## How auto chose" in report


def test_inspect_checks_the_plan_against_its_model(tmp_path, capsys):
    out_dir = tmp_path / "p"
    assert (
        run(capsys, "plan", "--model", "tiny-mlp", "--workers", "2", "--out", str(out_dir))[0] == 0
    )
    code, out, _ = run(capsys, "inspect", str(out_dir))
    assert code == 0 and "tiny-mlp on 2 workers" in out
    code, _, err = run(capsys, "inspect", str(out_dir), "--model", "tiny-local")
    assert code == 2 and "is for model 'tiny-mlp'" in err and err.count("\n") == 1
    code, _, err = run(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 2 and "no such plan file" in err


def test_plan_from_a_toml_file_with_network_override(tmp_path, capsys):
    spec = tmp_path / "net.toml"
    spec.write_text(
        'name = "n"\ninput = { features = 20 }\n[[layer]]\nkind = "dense"\nunits = 8\n'
        '[[layer]]\nkind = "dense"\nunits = 4\nactivation = "softmax"\n'
    )
    code, out, _ = run(
        capsys, "plan", "--model", str(spec), "--workers", "2", "--net", "bandwidth=10Gbit"
    )
    assert code == 0 and "n on 2 workers" in out


def test_graph_export(tmp_path, capsys):
    out = tmp_path / "g.graph"
    code, text, _ = run(capsys, "graph", "--model", "tiny-mlp", "--workers", "2", "--out", str(out))
    assert code == 0 and "blocks" in text
    header = out.read_text().splitlines()[0].split()
    assert header[2:] == ["111", "2"]
    code, _, _ = run(
        capsys, "graph", "--model", "tiny-mlp", "--format", "graphml", "--out", str(out)
    )
    assert code == 0 and "<graphml" in out.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "resnet", "--workers", "2"], "unknown model 'resnet'"),
        (
            ["--model", "tiny-mlp", "--workers", "2", "--method", "stripe", "--imbalance", "0.1"],
            "--imbalance does not apply to --method stripe",
        ),
        (
            ["--model", "tiny-mlp", "--workers", "2", "--capacities", "1,2,3"],
            "capacities must be 2 positive numbers",
        ),
        (["--model", "tiny-mlp", "--workers", "2", "--net", "rate=1"], "unknown key 'rate'"),
        (["--model", "BAD_TOML", "--workers", "2"], "malformed TOML"),
        (["--model", "BAD_GEOMETRY", "--workers", "2"], "kernel 7 is larger than its input"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, message):
    (tmp_path / "bad.toml").write_text("name = 'x'\ninput = { features = \n")
    (tmp_path / "geo.toml").write_text(
        "name = 'g'\ninput = { channels = 1, height = 5, width = 5 }\n"
        "[[layer]]\nkind = 'local'\nchannels = 2\nkernel = 7\n"
    )
    argv = [
        {"BAD_TOML": str(tmp_path / "bad.toml"), "BAD_GEOMETRY": str(tmp_path / "geo.toml")}.get(
            a, a
        )
        for a in argv
    ]
    out_dir = tmp_path / "out"
    code, _, err = run(capsys, "plan", *argv, "--out", str(out_dir))
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out_dir.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "tiny-mlp", "--workers", "0"], "must be >= 1"),
        (["plan", "--model", "tiny-mlp", "--workers", "2", "--method", "kmeans"], "invalid choice"),
        (["plan", "--model", "tiny-mlp", "--workers", "2", "--colour", "red"], "unrecognized"),
    ],
)
def test_argument_errors_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    code, _, err = run(
        capsys, "plan", "--model", "tiny-mlp", "--workers", "2", "--out", str(target)
    )
    assert code == 2 and "not a directory" in err
    assert target.read_text() == "keep me"


def test_out_that_holds_something_else_is_refused_and_left_alone(tmp_path, capsys):
    """A plan never writes into a training run or a foreign directory, nor a training run
    into a plan's or a foreign one; a plan directory may be planned into again."""
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    plan = tmp_path / "p3"
    argv = ["plan", "--model", "tiny-mlp", "--workers", "2", "--no-figures"]
    assert run(capsys, *argv, "--out", str(plan))[0] == 0
    before = (plan / "plan.json").read_bytes()
    assert run(capsys, *argv, "--out", str(plan))[0] == 0  # its own directory: replaced
    code, _, err = run(capsys, *argv, "--out", str(foreign))
    assert code == 2 and "not a plan directory (holds notes.txt)" in err
    for out in (foreign, plan):
        code, _, err = run(
            capsys,
            "train",
            "--model",
            "tiny-mlp",
            "--workers",
            "2",
            "--steps",
            "1",
            "--out",
            str(out),
        )
        assert code == 2 and "not a training run" in err and err.count("\n") == 1
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert (plan / "plan.json").read_bytes() == before
    assert not (plan / "train.json").exists()


def test_python_dash_m_entry_point_and_help():
    res = subprocess.run(
        [sys.executable, "-m", "netpart", "plan", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    for option in ("--model", "--workers", "--method", "--batch", "--compare", "--out", "--net"):
        assert option in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "netpart", "plan", "--model", "nope", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (OSError(errno.EROFS, "Read-only file system", "/ro/p"), 2),
        (OSError(errno.ENOSPC, "No space left on device", "/full/p"), 1),
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), 1),
    ],
)
def test_os_errors_are_one_line(tmp_path, capsys, monkeypatch, error, code):
    import netpart.files

    def refuse(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(netpart.files, "write_files", refuse)
    argv = ["plan", "--model", "tiny-mlp", "--workers", "2", "--out", str(tmp_path / "p")]
    got, _, err = run(capsys, *argv)
    assert got == code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and error.strerror in lines[0], lines


def test_a_testbed_job_s_stderr_passes_on_less_torchrun_s_exit_barrier_race():
    from netpart.cli.testbed import without_exit_barrier_race

    record = "E1127 21:24:24.549000 4081 torch/distributed/elastic/agent/server/api.py:1008] "
    lines = [
        "calibration rank 0: all-reduce among 2 machines\n",
        record + "Error waiting on exit barrier. Elapsed: 0.056 seconds\n",
        record + "Traceback (most recent call last):\n",
        record + "    store.wait([last_member_key])\n",
        record + "torch.distributed.DistNetworkError: Connection reset by peer\n",
        "E1127 21:24:25.001000 4082 torch/distributed/elastic/agent/server/api.py:700] other\n",
        "netpart: replica 1 stopped: its worker 0 exited\n",
    ]
    assert list(without_exit_barrier_race(lines)) == [lines[0], *lines[-2:]]
    assert list(without_exit_barrier_race(lines[2:4])) == lines[2:4]  # a record of its own


@pytest.mark.parametrize("what", [["--workers", "2"], ["--machines", "2"]])
def test_a_plan_piped_into_head_is_written_before_its_output(tmp_path, what):
    """The reader of the output may close it after one line: the files are written first,
    and the command exits 0 only once they are (issue 80, item 1)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "netpart", "plan", "--model", "tiny-local", *what]
    pipeline = " ".join([*cmd, "--out", str(out), "--no-figures" if "--workers" in what else ""])
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{pipeline} | head -1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == 1
    written = "plan.json" if "--workers" in what else "cluster.json"
    assert (out / written).exists(), sorted(p.name for p in out.iterdir()) if out.exists() else None


def test_a_testbed_job_s_benign_torch_warnings_stay_out_of_the_console():
    """Issue 80, item 6: a run that exits 0 filled its console with these."""
    from netpart.cli.testbed import without_exit_barrier_race

    lines = [
        "[W1201 10:00:00.1 socket.cpp:759] [c10d] The hostname of the client socket cannot be "
        "retrieved. err=-3\n",
        "W1201 10:00:01.000000 77 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:"
        "1346] The node 'n' has failed to send a keep-alive heartbeat to the rendezvous 'r' due "
        "to an error of type RendezvousConnectionError.\n",
        "replica steps 12/12: loss 0.1, 100 samples/s, 5 ms/step, 1 MB moved\n",
        "W1201 10:00:02.000000 77 torch/x.py:1] a warning of another kind\n",
    ]
    assert list(without_exit_barrier_race(lines)) == lines[2:]


def test_inspect_checks_what_train_plan_checks(tmp_path, capsys):
    """Issue 80, item 17: `inspect` printed 'on 3 workers' for a directory whose node map
    was another plan's (one killed between its two files), which `train --plan` refuses."""
    two, three = tmp_path / "two", tmp_path / "three"
    for out, n in ((two, "2"), (three, "3")):
        assert main(["plan", "--model", "tiny-local", "--workers", n, "--out", str(out)]) == 0
    (three / "node_map.npy").write_bytes((two / "node_map.npy").read_bytes())
    capsys.readouterr()
    assert main(["inspect", str(three)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the plan files do not belong together" in err
