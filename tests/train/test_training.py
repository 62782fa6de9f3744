"""Training jobs in real processes (gloo): few, bounded, and none leaves a process behind."""

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from netpart.cli import main
from netpart.compile.compiled import COMPILED
from netpart.compile.shards import ShardLayout
from netpart.data import load_data
from netpart.models import build_reference, load_spec
from netpart.models.dropout import training_key
from netpart.partition import build_unit_graph, plan
from netpart.runtime import WorkerFailure
from netpart.train import train
from netpart.train.config import TrainConfig
from netpart.train.rundir import model_from_shards
from tests.conftest import count_processes, wait_for_lines

pytestmark = pytest.mark.timeout(240)

SPEC = load_spec("tiny-local")
# The sync runs' model: tiny-local with dropout on the outputs of its two locally connected
# layers (plan-independent masks: the equalities below hold with dropout on).
DROPPED = {0: 0.3, 3: 0.2}
SYNC_SPEC = dataclasses.replace(
    SPEC,
    layers=tuple(
        dataclasses.replace(layer, dropout=DROPPED.get(i)) for i, layer in enumerate(SPEC.layers)
    ),
)


def alive() -> int:
    return count_processes(b"netpart.train.process")


def metrics(run: Path, replica: int = 0) -> list[dict]:
    text = (run / f"metrics_replica{replica}.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == 0, "a training process outlived its test"


def sync_config(steps: int, **changes) -> TrainConfig:
    """Sync SGD, 2 replicas + 3 shards, float64, batch 8, a checkpoint every update (fields
    `changes` changed): the sync runs' job."""
    flat = {
        "replicas": 2,
        "shards": 3,
        "mode": "sync",
        "optimizer": "sgd",
        "lr": 0.1,
        "steps": steps,
        "batch": 8,
        "dtype": "float64",
        "timeout": 30,
        "checkpoint_every": 1,
    }
    return TrainConfig.of(**{**flat, **changes})


LAUNCHER_COMPILES: list[logging.LogRecord] = []  # the sync run's launcher's compilations


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """Sync SGD, 2 replicas x 2 workers + 3 shards, float64, 4 steps (dropout on)."""
    run = tmp_path_factory.mktemp("sync") / "run"
    p = plan(SYNC_SPEC, 2, "metis")
    counter = logging.Handler()
    counter.emit = LAUNCHER_COMPILES.append
    compiled_log = logging.getLogger("netpart.compile.compiled")
    level = compiled_log.level
    compiled_log.addHandler(counter)
    compiled_log.setLevel(logging.INFO)
    try:
        train(SYNC_SPEC, p, sync_config(4), run)
    finally:
        compiled_log.removeHandler(counter)
        compiled_log.setLevel(level)
    return p, run


def test_a_job_compiles_its_plan_once_per_process(sync_run):
    """The graph, the schedule and the shard layout are built once in the launcher and once
    in each of the job's processes (`netpart.compile.compiled.COMPILED` in its log)."""
    _, run = sync_run
    assert [r.getMessage().split(":")[0] for r in LAUNCHER_COMPILES] == [COMPILED]
    logs = sorted((run / "logs").glob("rank*.log"))
    assert len(logs) == 2 * 2 + 3
    for path in logs:
        assert path.read_text().count(COMPILED) == 1, path.name


def test_sync_equals_single_process_sgd_on_the_concatenated_batch(sync_run):
    _, run = sync_run
    got = torch.load(run / "model.pt", weights_only=True)
    ref = build_reference(SYNC_SPEC, 0, torch.float64)
    data = load_data("synthetic", SYNC_SPEC, 0, TrainConfig().data.examples)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for t in range(1, 5):
        xs, ys = zip(*[data.batch(r, 2, t, 8, torch.float64) for r in range(2)], strict=True)
        opt.zero_grad()
        key = training_key(SYNC_SPEC, TrainConfig().run.seed, t)  # replica r's samples: r * 8 on
        ref.loss(ref(torch.cat(xs), key), torch.cat(ys)).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-12), k


def test_sync_pushes_are_never_stale(sync_run):
    _, run = sync_run
    for s in range(3):
        meta = json.loads((run / f"shard_{s}.json").read_text())
        assert set(meta["staleness"]) == {"0"} and sum(meta["staleness"].values()) > 0


def test_resume_continues_from_identical_parameters(sync_run, tmp_path):
    p, straight = sync_run
    run = tmp_path / "run"
    train(SYNC_SPEC, p, sync_config(2), run)
    half = torch.load(run / "model.pt", weights_only=True)
    meta = json.loads((run / "shard_0.json").read_text())
    assert meta["clock"] == 2 and meta["progress"] == {"0": 2, "1": 2}
    train(SYNC_SPEC, p, sync_config(4), run, resume=True)
    got = torch.load(run / "model.pt", weights_only=True)
    want = torch.load(straight / "model.pt", weights_only=True)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-13), k
        assert not torch.equal(half[k], want[k]) or "bias" in k
    steps = [m["step"] for m in metrics(run)]
    assert steps == [1, 2, 3, 4]  # the resumed replicas went on with steps 3 and 4


def test_sync_resume_after_a_signal_equals_the_uninterrupted_run(sync_run, tmp_path):
    """SIGTERM mid-run (the replicas may stop one step apart), then resume: the same
    parameters as a run never stopped (a stop ends on a step every replica finished)."""
    p, _ = sync_run
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(SYNC_SPEC, p, sync_config(120), straight)

    def signal_when_running() -> None:
        wait_for_lines(run / "metrics_replica1.jsonl", 15, poll=0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler: stop every process

    threading.Thread(target=signal_when_running, daemon=True).start()
    stopped = train(SYNC_SPEC, p, sync_config(120), run)
    assert stopped.stopped and max(stopped.steps.values()) < 120
    train(SYNC_SPEC, p, sync_config(120), run, resume=True)
    got = torch.load(run / "model.pt", weights_only=True)
    want = torch.load(straight / "model.pt", weights_only=True)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-12), k


@pytest.mark.parametrize("shards, n_push, n_fetch", [(3, 1, 1), (2, 3, 2)])
def test_downpour_with_local_steps_and_one_replica_is_single_process_sgd(
    tmp_path, shards, n_push, n_fetch
):
    """The replica applies every step itself and brings fetched values up to date with its
    pushes still in flight (and its unpushed steps): one replica's run equals plain SGD,
    whatever its pushes and fetches overlap. A shard one worker alone pushes to counts none
    of its pushes as stale and answers every fetch after the first CURRENT (with a push or
    alone), sending no values; with 3 shards the middle
    one holds both workers' values (each one's pushes are updates the other did not see), and
    its values are mixed with the CURRENT answers of the others."""
    p = plan(SPEC, 2, "metis")
    steps = 9
    cfg = TrainConfig.of(
        replicas=1,
        shards=shards,
        optimizer="sgd",
        lr=0.1,
        steps=steps,
        batch=8,
        dtype="float64",
        n_push=n_push,
        n_fetch=n_fetch,
        timeout=30,
    )
    assert cfg.local_steps
    run = tmp_path / "run"
    train(SPEC, p, cfg, run)
    got = torch.load(run / "model.pt", weights_only=True)
    ref = build_reference(SPEC, 0, torch.float64)
    data = load_data("synthetic", SPEC, 0, cfg.data.examples)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        x, y = data.batch(0, 1, t, 8, torch.float64)
        loss = ref.loss(ref(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-12), k
    # Every step trained on the values plain SGD had then: the same losses.
    assert [m["loss"] for m in metrics(run)] == pytest.approx(losses, rel=0, abs=1e-12)
    layout = ShardLayout.build(build_unit_graph(SPEC, p.granularity), p.node_map, 2, shards)
    for s in range(shards):
        meta = json.loads((run / f"shard_{s}.json").read_text())
        alone = len(layout.peers(s)) == 1
        assert alone == (set(meta["staleness"]) == {"0"})
        first = 8 * int(layout.shard_sizes()[s])  # values sent: the first fetch, then only
        assert meta["bytes_out"] == first if alone else meta["bytes_out"] > 3 * first  # shared


def test_downpour_lowers_the_loss_and_pushes_reach_only_their_shards(tmp_path):
    p = plan(SPEC, 2, "metis")
    cfg = TrainConfig.of(replicas=2, shards=2, steps=40, n_push=2, n_fetch=3, lr=0.05, timeout=30)
    summary = train(SPEC, p, cfg, tmp_path / "run")
    first = metrics(tmp_path / "run")[0]
    for r in (0, 1):
        assert summary.steps[r] == 40 and summary.final_loss[r] < 0.5 * first["loss"]
    layout = ShardLayout.build(build_unit_graph(SPEC, p.granularity), p.node_map, 2, 2)
    pushes = 40 // 2  # per worker and replica
    for s in range(2):
        meta = json.loads((tmp_path / "run" / f"shard_{s}.json").read_text())
        # Bytes that reached shard s: exactly the route lengths of the workers routed to it.
        want = (
            sum(seg.length for w in range(2) for seg in layout.routes(w).get(s, ()))
            * 4
            * pushes
            * 2
        )
        assert meta["bytes_in"] == want and meta["updates"] == pushes * len(layout.peers(s)) * 2


@pytest.mark.parametrize("mode", ["downpour", "sync"])  # sync: the shards serve in rounds
def test_a_dead_replica_does_not_stop_training(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("NETPART_TEST_FAULT", "die:3@5")  # replica 1, worker 1, step 5
    p = plan(SPEC, 2, "metis")
    cfg = TrainConfig.of(replicas=2, shards=2, steps=30, lr=0.05, timeout=10, mode=mode)
    summary = train(SPEC, p, cfg, tmp_path / "run")
    # The worker that died is named, not its mate that failed because it was gone.
    assert list(summary.lost) == [1] and summary.lost[1] == "worker 1 exited with code 17"
    assert summary.steps[0] == 30 and summary.steps[1] == 4
    losses = [m["loss"] for m in metrics(tmp_path / "run")]
    assert losses[-1] < 0.5 * losses[0]


def test_a_diverging_run_fails_in_one_line_and_writes_no_model(tmp_path, capsys):
    """No replica pushes a non-finite loss's gradient; when all are gone the job fails (exit
    1) naming the cause, and writes no model.pt or summary.json with NaN in it."""
    run = tmp_path / "run"
    argv = ["train", "--model", "tiny-mlp", "--workers", "1", "--replicas", "2", "--ps-shards"]
    code = main(
        [*argv, "1", "--optimizer", "sgd", "--lr", "1e38", "--steps", "50", "--out", str(run)]
    )
    err = capsys.readouterr().err
    assert code == 1 and "training diverged" in err and "lower --lr" in err
    assert not (run / "model.pt").exists() and not (run / "summary.json").exists()

    def refuse(constant: str) -> None:
        pytest.fail(f"{constant} in a metrics line")

    for path in run.glob("metrics_replica*.jsonl"):  # every line is valid, finite JSON
        for line in path.read_text().splitlines():
            json.loads(line, parse_constant=refuse)


def test_sigterm_stops_cleanly_with_a_final_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    args = "train --model tiny-local --workers 2 --replicas 1 --steps 2000 --timeout 20"

    def signal_when_running() -> None:
        wait_for_lines(run / "metrics_replica0.jsonl", 3)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler: stop every process

    threading.Thread(target=signal_when_running, daemon=True).start()
    assert main([*args.split(), "--out", str(run)]) == 130
    last = capsys.readouterr().out.strip().splitlines()[-1]  # how to go on (issue 80, item 7)
    assert last.startswith("stopped at a step boundary: ") and f"--resume {run}" in last, last
    steps = len(metrics(run))
    for s in range(2):
        meta = json.loads((run / f"shard_{s}.json").read_text())
        assert meta["progress"]["0"] == steps  # the last step was pushed before goodbye
    assert torch.load(run / "model.pt", weights_only=True)


def test_bad_resume_input_exits_2_and_overwrites_nothing(sync_run, tmp_path, capsys):
    _, straight = sync_run
    run = tmp_path / "copy"
    shutil.copytree(straight, run)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    x = str(tmp_path / "x")
    cases = [
        ["--resume", str(run), "--model", "tiny-mlp"],
        ["--resume", str(run), "--ps-shards", "2"],
        ["--resume", str(run), "--optimizer", "adagrad"],
        ["--resume", str(tmp_path / "nothing")],
        ["--model", "tiny-local", "--workers", "2", "--out", str(run)],
        [*"--model tiny-local --workers 2 --replicas 0 --out".split(), str(tmp_path / "x")],
        ["--model", "tiny-local", "--workers", "2", "--n-push", "0", "--out", x],
    ]
    for args in cases:
        assert main(["train", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("netpart: error:"), err
    lbfgs = tmp_path / "lbfgs"  # a Sandblaster run: refused until its history is checkpointed
    shutil.copytree(straight, lbfgs)
    manifest = json.loads((lbfgs / "train.json").read_text())
    manifest["config"]["cluster"]["mode"] = "sandblaster"
    manifest["config"]["optimiser"].update(name="lbfgs", units=1)
    (lbfgs / "train.json").write_text(json.dumps(manifest))
    assert main(["train", "--resume", str(lbfgs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Sandblaster L-BFGS run cannot be resumed" in err[0], err
    garbage = tmp_path / "garbage"  # a model.pt that is not one: one line, not torch's hint
    shutil.copytree(straight, garbage)
    (garbage / "model.pt").write_bytes(bytes(range(256)) * 2)
    assert main(["eval", str(garbage)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a model file netpart wrote" in err[0], err
    good = (run / "shard_0.pt").read_bytes()
    with zipfile.ZipFile(run / "shard_0.pt") as zf:  # 64 bytes flipped inside the values
        info = max(zf.infolist(), key=lambda i: i.file_size)
    at = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 8
    flipped = bytes(b ^ 0xFF for b in good[at : at + 64])
    (run / "shard_0.pt").write_bytes(good[:at] + flipped + good[at + 64 :])
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    assert "shard_0.pt: corrupt (" in capsys.readouterr().err
    (run / "shard_0.pt").write_bytes(good)
    (run / "shard_1.pt").write_bytes(b"not a checkpoint")
    before["shard_1.pt"] = b"not a checkpoint"
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    assert "shard_1.pt: not a readable netpart checkpoint" in capsys.readouterr().err
    after = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    assert after == before
    assert not (tmp_path / "x").exists()


def _torchrun_train(run: Path, restarts: int) -> subprocess.CompletedProcess:
    """`torchrun --standalone --max-restarts RESTARTS` of a tiny-local `netpart train` job of
    one worker and one replica into `run` (ranks: the worker 0, shards 1 and 2), shard 1
    (rank 2) dying at its 9th update (one replica: its updates come in order, so its
    checkpoint after the 8th holds exactly 8). Model workers exchanging under torchrun:
    test_multinode.py."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        *f"--standalone --nproc-per-node 3 --max-restarts {restarts}".split(),
        *"-m netpart train --model tiny-local --workers 1 --replicas 1 --ps-shards 2".split(),
        *"--steps 40 --checkpoint-every 4 --timeout 20 --out".split(),
        str(run),
    ]
    env = {**os.environ, "NETPART_TEST_FAULT": "die:2@9"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_torchrun_runs_the_job_restarts_a_dead_shard_and_export_loads_back(tmp_path):
    """The same job under torchrun: --max-restarts restarts every process after shard 1
    dies, the job goes on from the checkpoints (no --resume given) and the summary says
    what shard 1 lost; the run exports and evaluates as a local one does."""
    run = tmp_path / "run"
    out = _torchrun_train(run, 1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replica 0: step 40" in out.stdout and "Shard 1 died" in out.stdout
    (restart,) = json.loads((run / "summary.json").read_text())["restarts"]
    assert restart["shard"] == 1 and restart["checkpoint_updates"] == 8
    assert restart["lost_steps"]["0"] >= 1
    assert "held-out synthetic (1000 examples)" in out.stdout and (run / "report.md").exists()
    assert "[shard 0 (rank 1)]" in out.stderr  # logs name role and rank
    m = tmp_path / "m.pt"
    assert main(["export", str(run), "--format", "state_dict", "--out", str(m)]) == 0
    about = json.loads((tmp_path / "m.pt.json").read_text())  # beside it: how it was fed
    assert about["model"] == "tiny-local" and about["source"] == "synthetic"
    assert main(["eval", str(run), "--data", "digits"]) == 0  # from the shards
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    model = build_reference(SPEC, 0)
    model.load_state_dict(state)  # same names and shapes as the reference module
    assert not torch.equal(
        state["layers.0.weight"], build_reference(SPEC, 0).state_dict()["layers.0.weight"]
    )


def test_torchrun_without_restarts_fails_the_healthy_shard_too(tmp_path):
    """With no restart, the healthy shard 0 exits 1 too (a node running only it must not
    succeed): torchrun's failure summary lists rank 1 (shard 0) with exit code 1."""
    out = _torchrun_train(tmp_path / "run", 0)
    assert out.returncode != 0
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: 1 ", out.stderr)


def test_sigint_to_torchrun_stops_every_process_with_a_final_checkpoint(tmp_path):
    """torchrun passes SIGINT on; every netpart process stops at a step boundary, shard 0
    writes the model and a summary that says so. (torchrun itself then exits 1 with its
    SignalException: its policy, documented in docs/training.md.)"""
    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        *"--standalone --nproc-per-node 2 -m netpart train --model".split(),
        *"tiny-local --workers 1 --replicas 1 --ps-shards 1 --steps".split(),
        *"100000 --out".split(),
        str(run),
        *"--timeout 20".split(),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_lines(run / "metrics_replica0.jsonl", 3, timeout=90)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] and summary["steps"]["0"] < 100000, err.decode()[-2000:]
    assert torch.load(run / "model.pt", weights_only=True)
    assert b"wrote " in out  # shard 0 finished the run


def test_a_dead_shard_stops_the_job_with_its_last_checkpoint_intact(tmp_path, monkeypatch):
    monkeypatch.setenv("NETPART_TEST_FAULT", "die:3@9")  # shard 1 (rank 1*2+1), 9th update
    p = plan(SPEC, 2, "metis")
    # One replica: shard 1 serves worker 1 alone, so its updates come in order.
    cfg = TrainConfig.of(
        replicas=1, shards=2, steps=200, lr=0.05, timeout=10, checkpoint_every=4, restarts=0
    )
    with pytest.raises(
        WorkerFailure, match=r"shard 1 exited with code 17: .*--restarts 0.*--resume"
    ):
        train(SPEC, p, cfg, tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "shard_1.json").read_text())
    assert meta["updates"] == 8  # the checkpoint before the death, whole
    state = torch.load(tmp_path / "run" / "shard_1.pt", weights_only=True)
    assert json.loads(state["meta"])["updates"] == 8 and torch.isfinite(state["values"]).all()
    assert not list((tmp_path / "run").glob(".*.tmp"))


@pytest.mark.parametrize("fault, dead", [("die:3@9", [1]), ("die:2@9,die:3@9", [0, 1])])
def test_a_dead_shard_is_restarted_from_its_checkpoint_and_training_goes_on(
    tmp_path, monkeypatch, fault, dead
):
    """Shard 1 dies after its 9th update; or both shards at once, and both are named and
    restarted, not only the first (issue 80, item 13)."""
    monkeypatch.setenv("NETPART_TEST_FAULT", fault)
    p = plan(SPEC, 2, "metis")
    cfg = TrainConfig.of(replicas=1, shards=2, steps=60, lr=0.05, timeout=10, checkpoint_every=4)
    summary = train(SPEC, p, cfg, tmp_path / "run")
    assert sorted(r["shard"] for r in summary.restarts) == dead
    for restart in summary.restarts:
        assert restart["exit"] == "exited with code 17" and restart["checkpoint_updates"] == 8
    restart = summary.restarts[-1]  # both at once: in the order their deaths were seen
    if dead == [1]:  # both at once: the replica goes on from what both kept
        assert restart["shard"] == 1 and restart["lost_steps"]["0"] >= 1
    assert not summary.lost and not summary.stopped
    lines = metrics(tmp_path / "run")
    assert lines[-1]["step"] == 60  # every step was trained, once each after the restart
    loss = [m["loss"] for m in lines]
    assert sum(loss[-10:]) < sum(loss[:10])  # and the loss kept falling
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["restarts"] == summary.restarts
    assert (
        "Shard 1 exited with code 17 and was restarted"
        in (tmp_path / "run" / "report.md").read_text()
    )


def test_a_killed_zygote_is_blamed_and_the_job_restarted_from_its_checkpoints(tmp_path):
    """The preloaded interpreter that forked the job's processes is killed: its children die
    with it, and the restart names it, not shard 0 (issue 80, item 13)."""
    import threading

    run = tmp_path / "run"
    p = plan(SPEC, 2, "metis")
    cfg = TrainConfig.of(replicas=1, shards=2, steps=120, lr=0.05, timeout=10, checkpoint_every=4)
    out = {}
    job = threading.Thread(target=lambda: out.update(summary=train(SPEC, p, cfg, run)))
    job.start()
    try:
        deadline = time.monotonic() + 60
        while not (run / "shard_1.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        zygotes = [
            int(proc.name)
            for proc in Path("/proc").iterdir()
            if proc.name.isdigit() and _is_zygote(proc)
        ]
        assert len(zygotes) == 1, zygotes
        os.kill(zygotes[0], signal.SIGKILL)
    finally:
        job.join(timeout=120)
    assert not job.is_alive() and "summary" in out
    restarts = out["summary"].restarts
    assert sorted(r["shard"] for r in restarts) == [0, 1]
    blame = "was killed when the job's preloaded interpreter (zygote) died"
    assert all(r["exit"] == blame for r in restarts), restarts
    assert metrics(run)[-1]["step"] == 120


def _is_zygote(proc: Path) -> bool:
    """This test's zygote: the process of that command line whose parent is this one (its
    forked children share its command line)."""
    try:
        stat = (proc / "stat").read_text()
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        return (
            parent == os.getpid()
            and b"netpart.processes.zygote\0netpart.train.process"
            in (proc / "cmdline").read_bytes()
        )
    except OSError:
        return False


def test_eval_reports_held_out_digits_accuracy(tmp_path, capsys):
    run = tmp_path / "run"
    p = plan(SPEC, 2, "metis")
    cfg = TrainConfig.of(
        replicas=2, shards=2, steps=120, lr=0.05, data="digits", timeout=30, snapshot_every=80
    )
    train(SPEC, p, cfg, run)
    # Snapshots every 80 updates of each shard (240 each): 3 kept, each a loadable model.
    snaps = sorted((run / "snapshots").iterdir())
    assert [s.name for s in snaps] == ["00001", "00002", "00003"]
    layout = ShardLayout.build(build_unit_graph(SPEC, p.granularity), p.node_map, 2, 2)
    first = model_from_shards(SPEC, p, cfg, snaps[0], layout)
    assert json.loads((snaps[0] / "shard_1.json").read_text())["updates"] == 80
    final = torch.load(run / "model.pt", weights_only=True)
    assert not torch.equal(first["layers.0.weight"], final["layers.0.weight"])
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert "digits (held-out, 359 examples)" in out
    accuracy = float(out.rsplit("accuracy ", 1)[1])
    assert accuracy > 0.9  # measured 0.98 after 300 steps; 120 steps suffice for 0.9
    assert main(["eval", str(tmp_path / "none")]) == 2
    # The run directory's report: every step of every replica, in time order, and the plots.
    for name in ("curves.png", "step_time.png", "staleness.png", "report.md", "metrics.jsonl"):
        (run / name).unlink()
    assert main(["report", str(run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 240 and [x["time"] for x in lines] == sorted(x["time"] for x in lines)
    assert all(0 <= x["accuracy"] <= 1 and x["halo_bytes"] > 0 for x in lines)
    assert all(x["cpu_s"] >= 0 for x in lines) and sum(x["cpu_s"] for x in lines) > 0
    for name in ("curves.png", "step_time.png", "staleness.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (run / "report.md").read_text()
    held = json.loads((run / "summary.json").read_text())["held_out"]
    assert f"accuracy **{held['accuracy']:.4f}**" in report and held["examples"] == 359
    # Downpour: one staleness count per push; the shards' updates are those pushes.
    metas = [json.loads((run / f"shard_{s}.json").read_text()) for s in range(2)]
    assert sum(sum(m["staleness"].values()) for m in metas) == sum(m["updates"] for m in metas)
    assert main(["report", str(tmp_path / "none")]) == 2


def test_norm_triggered_pushes_and_dc_asgd_train(tmp_path):
    from netpart.train.replica import push_due

    grad = torch.full((4,), 0.5)  # norm 1.0
    assert push_due(5, 5, 0.0, grad) and not push_due(4, 5, 0.0, grad)
    assert push_due(4, 5, 1.0, grad) and not push_due(4, 5, 1.01, grad)
    p = plan(SPEC, 2, "metis")
    updates = {}
    for name, norm in (("eager", 1e-9), ("lazy", 1e9)):  # every step; every 5th step
        cfg = TrainConfig.of(
            replicas=2,
            shards=2,
            steps=40,
            n_push=5,
            push_norm=norm,
            dc_lambda=0.5,
            lr=0.05,
            timeout=30,
        )
        summary = train(SPEC, p, cfg, tmp_path / name)
        first = metrics(tmp_path / name)[0]
        assert summary.final_loss[0] < 0.5 * first["loss"]
        metas = [json.loads((tmp_path / name / f"shard_{s}.json").read_text()) for s in (0, 1)]
        updates[name] = sum(m["updates"] for m in metas)
    # 2 replicas x 2 workers (one shard each): 40 pushes each, or 8.
    assert updates == {"eager": 2 * 2 * 40, "lazy": 2 * 2 * 8}


def test_gradient_buffers_send_what_backward_accumulated_and_rotate():
    """Backward writes into the buffer a push sends; after a push the next buffer in turn is
    current and zeroed, and the pushed ones are left alone until their turn comes round
    again (the replica loop completes a push before then: it keeps at most two in flight)."""
    from netpart.train.replica import GradBuffers

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]

    class Model:  # what a ModelWorker offers: where its pieces' gradients go
        def bind_grads(self, flat):
            for p, view in zip(params, flat.split([12, 5]), strict=True):
                p.grad = view.view_as(p)

    grads = GradBuffers(Model(), [torch.zeros(17) for _ in range(3)])
    for _ in range(2):  # two steps accumulate before a push
        (params[0].square().sum() + params[1].sum()).backward()
    first = grads.flat
    want = torch.cat([2 * 2 * params[0].detach().reshape(-1), 2 * torch.ones(5)])
    assert torch.equal(first, want)  # backward wrote into the buffer a push sends
    grads.advance()
    params[1].sum().backward()
    second = grads.flat
    assert second is not first and torch.equal(first, want)  # the pushed buffer is left alone
    assert torch.equal(second[12:], torch.ones(5)) and not second[:12].any()
    grads.advance()
    assert grads.flat is not first and grads.flat is not second and not grads.flat.any()
    assert torch.equal(first, want) and torch.equal(second[12:], torch.ones(5))
    grads.advance()
    assert grads.flat is first and not first.any()  # its turn again: zeroed


@pytest.fixture
def small_disk(tmp_path):
    """A 450 kB tmpfs (root only): room for the run's first checkpoints, not for many more."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=450k", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_stops_the_job_in_one_line_with_the_last_checkpoint_intact(small_disk, capsys):
    run = small_disk / "run"
    argv = ["--model", "tiny-local", "--workers", "2", "--replicas", "2", "--ps-shards", "2"]
    start = time.monotonic()
    code = main(["train", *argv, "--steps", "300", "--timeout", "30", "--out", str(run)])
    took = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and took < 60, (code, took)
    assert len(err) == 1 and "No space left on device" in err[0] and "shard" in err[0], err
    assert alive() == 0
    meta = json.loads((run / "shard_0.json").read_text())
    assert meta["updates"] > 0  # a checkpoint written before the disk filled ...
    for s in (0, 1):  # ... that still loads: each shard's file is whole
        with zipfile.ZipFile(run / f"shard_{s}.pt") as zf:
            assert zf.testzip() is None


def test_tensorboard_logs_hold_the_run_s_curves(tmp_path):
    """`--log tensorboard` (where the package is installed; CI has it not): the launcher
    writes every replica's steps and the held-out evaluations as they arrive."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    argv = [
        *"train --model tiny-local --workers 2 --replicas 1 --steps 20".split(),
        *"--eval-every 10 --log tensorboard --out".split(),
        str(run),
    ]
    assert main(argv) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("held_out/loss")] == [10, 20]
    assert len(events.Scalars("train/loss/replica0")) == 20


def test_a_process_role_flushes_subnormals_in_the_threads_it_makes():
    """Every role's process (`compute_setup`) computes with subnormal floats flushed to zero,
    and so do the threads it starts afterwards (a step multiplies subnormals many times
    slower). In a child: the flag is the process's."""
    code = (
        "import threading, torch\n"
        "from netpart.train.process import compute_setup\n"
        "tiny = torch.tensor([1e-30])\n"
        "before = (tiny * 1e-10).item()\n"
        "compute_setup(1)\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append((tiny * 1e-10).item()))\n"
        "t.start(); t.join()\n"
        "print(before, (tiny * 1e-10).item(), seen[0], torch.get_num_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    before, after, in_thread, threads = map(float, out)
    assert before > 0  # a subnormal product, unflushed
    assert after == 0 and in_thread == 0
    assert threads == 1


def test_a_resume_refuses_links_and_cuts_a_torn_metrics_line(sync_run, tmp_path, capsys, caplog):
    """Issue 80, items 9 and 16: a run directory's file replaced by a symbolic link to a file
    outside it is refused before anything is written, the outside file untouched; a metrics
    file whose last line a killed writer tore goes on with whole lines; steps the checkpoints
    hold without a line (a job killed between a checkpoint and the line) are named."""
    _, straight = sync_run
    run = tmp_path / "copy"
    shutil.copytree(straight, run)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("mine\n")
    metrics_file = run / "metrics_replica0.jsonl"
    metrics_file.unlink()
    metrics_file.symlink_to(outside)
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics_replica0.jsonl: a symbolic link" in err[0], err
    assert outside.read_text() == "mine\n"
    metrics_file.unlink()
    lines = (straight / "metrics_replica0.jsonl").read_text().splitlines()
    metrics_file.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    other = run / "metrics_replica1.jsonl"  # its last two lines never written
    other.write_text("".join(x + "\n" for x in other.read_text().splitlines()[:-2]))
    with caplog.at_level(logging.WARNING, logger="netpart.train.rundir"):
        assert main(["train", "--resume", str(run), "--steps", "6"]) == 0
    steps = [json.loads(x)["step"] for x in metrics_file.read_text().splitlines()]
    assert steps == [1, 2, 3, 5, 6]  # step 4's torn line cut, the resume's lines whole
    said = [r.getMessage() for r in caplog.records if "not logged" in r.getMessage()]
    assert [m.split(" trained")[0] for m in said] == ["replica 0: step 4", "replica 1: steps 3-4"]
