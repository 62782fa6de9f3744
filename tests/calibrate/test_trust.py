"""A calibration knows when it cannot be trusted: the machine's load between measurements,
its runs' spread and its fitted terms decide; a busy machine is refused before measuring."""

from dataclasses import replace

from netpart.calibrate import measure, trust
from netpart.calibrate.trust import LoadSample, implausible, sample, verdict
from netpart.cli import main
from netpart.cost.machine import Machine

QUIET = LoadSample(seconds=0.5, others_cores=0.02, steal=0.0, loadavg=0.1)
BUSY = LoadSample(seconds=0.5, others_cores=0.9, steal=0.0, loadavg=1.2)
CALIBRATED = Machine(profile="p.json", parallel_slowdown=0.38)


def test_a_quiet_calibration_is_trusted_and_a_busy_one_says_why():
    assert verdict([QUIET] * 5, [1.05, 1.1], CALIBRATED).trusted
    busy = verdict([QUIET, BUSY, BUSY], [1.05], CALIBRATED)
    assert not busy.trusted and "0.90 cores busy" in busy.reasons[0]
    assert verdict([BUSY, QUIET, QUIET], [1.05], CALIBRATED).trusted  # one outlier does not
    stolen = replace(QUIET, steal=0.2)
    assert "stole 20%" in verdict([stolen] * 3, [1.0], CALIBRATED).reasons[0]
    assert "differed 2.00x" in verdict([QUIET], [2.0, 2.0, 1.0], CALIBRATED).reasons[0]


def test_a_fitted_term_a_quiet_machine_never_gives_is_flagged():
    """The issue's loaded machine fitted two workers' compute x2.59 slower than one's."""
    loaded = replace(CALIBRATED, parallel_slowdown=1.59)
    assert implausible(CALIBRATED) == []
    assert "x2.59" in implausible(loaded)[0]
    judged = verdict([QUIET], [1.0], loaded)
    assert not judged.trusted and judged.caveat().startswith("calibrated on a busy machine")


def test_a_profile_kept_with_force_says_so_in_every_prediction():
    marked = replace(CALIBRATED, caveat="calibrated on a busy machine: x")
    back = Machine.from_dict(marked.to_dict())
    assert back.caveat == marked.caveat
    assert "WARNING: calibrated on a busy machine" in back.describe()
    assert "WARNING" not in CALIBRATED.describe()


def test_the_machine_is_sampled_while_this_process_sleeps():
    s = sample(0.2)
    assert 0.15 < s.seconds < 2 and s.others_cores >= 0 and 0 <= s.steal <= 1


def test_a_busy_machine_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trust, "sample", lambda seconds=1.0: BUSY)
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "stayed busy" in err and "--force" in err and err.count("\n") == 1
    assert not out.exists()


def test_an_untrusted_calibration_is_made_again_once_then_refused(tmp_path, capsys, monkeypatch):
    """Without --force; with it the first is kept at once (test_calibrate.py's real one)."""
    made = []

    def calibrate(*_, **__):
        made.append(1)
        return replace(CALIBRATED, parallel_slowdown=1.59), {"load": [], "runs": []}

    monkeypatch.setattr(trust, "sample", lambda seconds=1.0: QUIET)
    monkeypatch.setattr(measure, "calibrate", calibrate)
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--out", str(out)]) == 1
    said, err = capsys.readouterr()
    assert len(made) == 2 and said.count("calibrating again") == 1
    assert "calibrated twice on a busy machine (implausible" in err and err.count("\n") == 1
    assert not out.exists() and not list(tmp_path.iterdir())
