"""How to spend M machines: every layout is counted, priced as the module says (a shard's link
carries R times one replica's share, a ring all-reduce 2(M-1)/M of the model), and the fastest
that fits is recommended; the advice round-trips through JSON and the command writes it."""

import json

import pytest

from netpart.cli import main
from netpart.cost.machine import Machine
from netpart.errors import PlanError
from netpart.models import load_spec
from netpart.models.spec import BYTES_PER_VALUE
from netpart.partition.planner import plan
from netpart.planning.cluster import (
    UPDATE_S_PER_VALUE,
    ClusterAdvice,
    advise,
    trainable,
)

NET = Machine(bandwidth_bps=1e9, latency_s=50e-6, message_s=20e-6)


def test_a_ring_all_reduce_is_2_m_minus_1_phases_of_a_machines_share():
    values, m = 1_000_000, 4
    phase = NET.latency_s + NET.message_s + BYTES_PER_VALUE * values / m * 8 / NET.bandwidth_bps
    assert NET.allreduce_s(values, m) == pytest.approx(2 * (m - 1) * phase)
    assert NET.allreduce_s(values, 1) == 0.0


def test_an_all_reduce_step_is_one_workers_step_the_ring_and_a_whole_models_update():
    spec = load_spec("tiny-mlp")
    values = (64 + 1) * 32 + (32 + 1) * 10  # weights and biases
    step = plan(spec, 1, seed=0, batch=16, network=NET).metrics.predicted_step_s
    for m in (1, 3):
        ring = next(
            f for f in advise(spec, m, NET, batch=16).layouts if f.layout.mode == "allreduce"
        )
        priced = step + NET.allreduce_s(values, m) + values * UPDATE_S_PER_VALUE
        assert ring.step_s == pytest.approx(priced)


def test_every_layout_uses_the_machines_and_the_fastest_fitting_is_first():
    spec = load_spec("tiny-mlp")
    advice = advise(spec, 5, NET, batch=16)
    names = {str(f.layout) for f in advice.layouts}
    assert {"all-reduce x5", "downpour 4x1+1", "sync 1x4+1", "downpour 2x2+1"} <= names
    assert all(f.layout.machines == 5 for f in advice.layouts)
    speeds = [f.samples_per_s for f in advice.layouts]
    assert speeds == sorted(speeds, reverse=True) and advice.best.fits
    assert ClusterAdvice.from_dict(json.loads(json.dumps(advice.to_dict()))) == advice


def test_a_shard_link_carries_r_times_a_replica_share():
    spec = load_spec("tiny-mlp")
    by = {str(f.layout): f for f in advise(spec, 7, NET).layouts}
    one, three = by["downpour 1x2+5"], by["downpour 3x2+1"]
    single = {str(f.layout): f for f in advise(spec, 3, NET).layouts}["downpour 1x2+1"]
    assert three.link_bytes == pytest.approx(3 * single.link_bytes)
    assert one.link_bytes < single.link_bytes  # five shards split the replica's values
    assert by["downpour 3x2+1"].staleness == 2 and by["sync 3x2+1"].staleness == 0


def test_layouts_that_do_not_fit_are_marked_and_never_recommended():
    spec = load_spec("tiny-mlp")
    free = advise(spec, 4, NET)
    worst = max(f.memory_bytes for f in free.layouts)
    best = min(f.memory_bytes for f in free.layouts)
    assert best < worst
    squeezed = advise(spec, 4, NET, memory_per_machine=(best + worst) / 2)
    assert squeezed.best.fits and not all(f.fits for f in squeezed.layouts)
    with pytest.raises(PlanError, match="no layout of 4 machines fits"):
        advise(spec, 4, NET, memory_per_machine=best / 2)


def test_plan_machines_prints_and_writes_the_advice(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["plan", "--model", "tiny-mlp", "--machines", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "all-reduce x4" in text
    advice = json.loads((out / "cluster.json").read_text())
    assert advice["machines"] == 4 and advice["layouts"][0]["fits"]
    assert (out / "cluster.png").read_bytes()[:4] == b"\x89PNG"
    assert "Recommended" in (out / "report.md").read_text()
    assert main(["plan", "--model", "tiny-mlp", "--machines", "4", "--workers", "2"]) == 2


def test_train_machines_trains_the_fastest_parameter_server_layout(tmp_path, capsys):
    """`train --machines M` runs what `plan --machines M` ranks first among the layouts
    netpart trains (all-reduce is DDP's), and says so; it refuses a layout given besides."""
    advice = advise(load_spec("digits-mlp"), 4, Machine(), batch=32, max_workers=4)
    choice = trainable(advice)
    assert choice.layout.mode != "allreduce" and choice.fits
    assert all(
        f.samples_per_s <= choice.samples_per_s
        for f in advice.layouts
        if f.layout.mode != "allreduce"
    )
    run = tmp_path / "run"
    argv = [
        *"train --model digits-mlp --machines 4 --data digits --steps".split(),
        *"10 --batch 32 --out".split(),
        str(run),
    ]
    assert main(argv) == 0
    assert f"--machines 4: training {choice.layout}" in capsys.readouterr().out
    job, lay = json.loads((run / "train.json").read_text()), choice.layout
    cluster = job["config"]["cluster"]
    assert (job["workers"], cluster["replicas"], cluster["shards"], cluster["mode"]) == (
        lay.workers,
        lay.replicas,
        lay.shards,
        lay.mode,
    )
    assert main([*argv[:-2], "--workers", "2", "--out", str(tmp_path / "b")]) == 2
    assert "--machines chooses the layout: drop --workers" in capsys.readouterr().err
    with pytest.raises(PlanError, match="no parameter-server layout"):
        trainable(advise(load_spec("digits-mlp"), 1, NET))


def test_downpour_carries_push_and_fetch_beside_its_step_and_sync_waits_for_each():
    """On a slow link: Downpour 1x1+1's step is one push-and-fetch (both ways at once, beside
    the compute), sync's the compute, the push, the update and the fetch in turn."""
    spec = load_spec("tiny-mlp")
    slow = Machine(bandwidth_bps=1e6, latency_s=50e-6)
    by = {str(f.layout): f for f in advise(spec, 2, slow, batch=16).layouts}
    down, sync = by["downpour 1x1+1"], by["sync 1x1+1"]
    phase = float(slow.phase_s(down.link_bytes, 1))
    assert down.step_s == pytest.approx(phase)
    assert 2 * phase < sync.step_s < 2.05 * phase


def test_layouts_predicted_within_the_tie_are_reported_as_a_tie():
    """Issue 80, item 5: 'downpour 3x1+3 ... 1.00x the next (all-reduce x6)' read as a
    recommendation the model cannot make."""
    from netpart.planning.cluster import TIE, Layout, LayoutFigures, _why

    def row(mode, r, n, s, speed, link):
        layout = Layout(mode, r, n, s)
        return LayoutFigures(layout, 1 / speed, speed, link, "shard 0", 1e6, 0.0, True)

    tie = [row("downpour", 3, 1, 3, 1000.0, 2e5), row("allreduce", 6, 1, 0, 990.0, 5e5)]
    said = _why(tie)
    assert said.startswith("downpour 3x1+3 and all-reduce x6 are a tie") and "1.010x" in said
    assert "0.2 MB a step, all-reduce x6's 0.5 MB" in said
    apart = [tie[0], row("allreduce", 6, 1, 0, 1000.0 / (1 + 2 * TIE), 5e5)]
    assert "1.10x the next (all-reduce x6)" in _why(apart)
