"""Machine description files: the schema round-trips, a hand-written file with a bad key or unit is
refused in one line naming it, a machine's prediction is what its figures say, and the same
file draws the same Figure 3 (nothing of this host enters it)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from netpart.cli import main
from netpart.cost.machine import PATCHES, Machine
from netpart.cost.sheet import KindRate, MachineSheet, read_sheet, sheet_toml
from netpart.cost.tables import KindCost
from netpart.errors import PlanError

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "experiments" / "machines" / "paper-2012.toml"

GOOD = """schema_version = 1
name = "spec-sheet"
about = "by hand"
[compute]
rate = "95 GFLOP/s"
overhead = "20 us"
threads = 16
[compute.kinds.dense]
rate = "120 GFLOP/s"
[network]
bandwidth = "10 Gbit/s"
latency = "30 us"
message = "5 us"
[step]
overhead = "1 ms"
[memory]
per_worker = "48 GiB"
"""


def write(tmp_path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_hand_written_file_reads_in_si_units(tmp_path):
    m = read_sheet(write(tmp_path, GOOD))
    assert m.flops_per_s == 95e9 and m.overhead_s == pytest.approx(20e-6)
    assert m.kinds == {"dense": KindRate(120e9, 0.0)}
    assert m.threads == 16 and m.bandwidth_bps == 10e9 and m.latency_s == pytest.approx(30e-6)
    assert m.message_s == pytest.approx(5e-6) and m.step_overhead_s == pytest.approx(1e-3)
    assert m.memory_bytes == 48 * 2**30


def test_the_schema_round_trips_through_json_and_toml(tmp_path):
    m = read_sheet(write(tmp_path, GOOD))
    assert MachineSheet.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert read_sheet(write(tmp_path, json.dumps(m.to_dict()), "m.json")) == m
    again = read_sheet(write(tmp_path, sheet_toml(m), "again.toml"))
    assert _close(again, m)


def _close(a: MachineSheet, b: MachineSheet) -> bool:
    da, db = a.to_dict(), b.to_dict()
    for section in ("compute", "network", "step", "memory"):
        for key, value in db[section].items():
            if key == "kinds":
                for kind, r in value.items():
                    assert da[section][key][kind] == pytest.approx(r)
            else:
                assert da[section][key] == pytest.approx(value), (section, key)
    return da["name"] == db["name"] and da["about"] == db["about"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("[network]", '[network]\nbandwith = "1 Gbit/s"'), "unknown key 'network.bandwith'"),
        (('rate = "95 GFLOP/s"', 'rate = "95 Gbit/s"'), "compute.rate = '95 Gbit/s'"),
        (('latency = "30 us"', "latency = 30"), "network.latency = 30: give a unit"),
        (('rate = "120 GFLOP/s"', 'rate = "-1 GFLOP/s"'), "compute.kinds.dense.rate"),
        (("[compute.kinds.dense]", "[compute.kinds.fully]"), "compute.kinds.fully"),
        (("threads = 16", "threads = 0"), "compute.threads"),
        (("schema_version = 1", "schema_version = 7"), "schema_version must be 1"),
        (
            ('[memory]\nper_worker = "48 GiB"', '[memory]\nper_worker = "48 GFLOP/s"'),
            "memory.per_worker",
        ),
    ],
)
def test_a_bad_key_or_unit_is_one_line_naming_it(tmp_path, change, named):
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(PlanError) as exc:
        read_sheet(path)
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_the_command_line_refuses_a_bad_machine_in_one_line(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("[network]", "[network]\nspeed = 3"))
    assert main(["plan", "--model", "tiny-mlp", "--workers", "2", "--machine", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown key 'network.speed'" in err and err.count("\n") == 0


def test_a_machine_predicts_overhead_plus_flops_over_its_rate():
    m = MachineSheet(
        name="m", flops_per_s=50e9, overhead_s=1e-4, kinds={"dense": KindRate(100e9, 2e-5)}
    )
    net = m.to_machine()
    flops = np.array([[1e6, 2e7], [3e5, 0.0]])
    got = net.worker_compute_s(flops, 32, kinds=["dense", "local"])
    want = np.array([[2e-5 + 32e6 / 100e9, 2e-5 + 64e7 / 100e9], [1e-4 + 96e5 / 50e9, 0.0]])
    assert got == pytest.approx(want, rel=1e-12)
    assert net.phase_s(np.array([1e6]), peers=3) == pytest.approx(
        m.latency_s + 3 * m.message_s + 8e6 / m.bandwidth_bps
    )


def test_a_calibrated_model_becomes_absolute_rates():
    """Each kind's rate is its largest slices', its overhead what its smallest take beyond
    that rate, its cost per value the profile's."""
    f = np.array([1e3, 1e4, 1e5, 1e10, 1e11, 1e12])
    kinds = {
        "dense": KindCost(tuple(zip(f, 3e-5 + f / 40e9, strict=True)), per_value=1e-9),
        "local": KindCost(tuple(zip(f, 1e-5 + f / 10e9, strict=True))),
    }
    net = Machine(kinds=kinds, bandwidth_bps=2e9, latency_s=7e-5, step_fixed_s=2e-3)
    m = MachineSheet.from_machine(net, name="host")
    assert m.flops_per_s == pytest.approx(40e9, rel=1e-4)
    assert m.overhead_s == pytest.approx(3e-5, rel=1e-3) and m.per_value_s == 1e-9
    assert m.kinds["local"].flops_per_s == pytest.approx(10e9, rel=1e-4)
    assert m.bandwidth_bps == 2e9 and m.step_overhead_s == 2e-3


def test_the_paper_machine_draws_the_same_curve_anywhere_any_day():
    """Two draws from one machine file are identical, and equal the committed result (drawn
    on another day): nothing measured on this host enters a machine's prediction."""
    sys.path.insert(0, str(ROOT))
    from experiments.scaling import curves

    machine = read_sheet(PAPER)
    first = curves(machine, ["speech"], [1, 2, 4, 8, 16])
    assert curves(machine, ["speech"], [1, 2, 4, 8, 16]) == first
    committed = json.loads((ROOT / "experiments" / "results" / "figure3.json").read_text())
    saved = {r["workers"]: r["speedup"] for r in committed["rows"] if r["model"] == "speech"}
    assert {r["workers"]: r["speedup"] for r in first} == {n: saved[n] for n in (1, 2, 4, 8, 16)}
    peak = max(first, key=lambda r: r["speedup"])
    assert 4 <= peak["workers"] <= 16 and 1.6 <= peak["speedup"] <= 2.8


def test_plan_sweep_reads_the_machine_and_names_it(capsys):
    assert main(["plan", "--model", "speech", "--sweep", "1-32", "--machine", str(PAPER)]) == 0
    out = capsys.readouterr().out
    assert "machine paper-2012" in out
    knee = int(out.rsplit("book ", 1)[1].split(" worker")[0])
    assert 4 <= knee <= 16


def test_the_figure3_experiment_writes_its_files(tmp_path):
    sys.path.insert(0, str(ROOT))
    from experiments.scaling import main as figure3

    assert figure3(["--models", "tiny-local", "--workers", "1,2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "figure3.json").read_text())["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert rows[1]["band_low"] <= rows[1]["speedup"] <= rows[1]["band_high"]
    assert (tmp_path / "figure3.png").read_bytes()[:4] == b"\x89PNG"
    assert "| tiny-local |" in (tmp_path / "figure3.md").read_text()


def test_a_file_may_price_a_conv_layer_s_gathered_patches_apart(tmp_path):
    text = GOOD + '[compute.kinds.conv-patches]\nrate = "5 GFLOP/s"\noverhead = "50 us"\n'
    sheet = read_sheet(write(tmp_path, text))
    rate = sheet.kinds[PATCHES]
    assert (rate.flops_per_s, rate.overhead_s) == pytest.approx((5e9, 5e-5), rel=1e-12)
    again = read_sheet(write(tmp_path, sheet_toml(sheet), "again.toml"))
    assert again == sheet
    machine = sheet.to_machine()
    assert float(machine.kinds[PATCHES].seconds(np.array([5e9]))[0]) == pytest.approx(1 + 5e-5)
    assert PATCHES not in read_sheet(write(tmp_path, GOOD, "plain.toml")).to_machine().kinds
