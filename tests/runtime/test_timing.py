"""How many steps a timed run takes (`netpart run`, `netpart calibrate`): enough to settle."""

from netpart.runtime.step import MOST_STEPS, timed_steps


def test_a_timed_run_covers_its_least_steps_and_about_its_seconds():
    assert timed_steps(0.2) == (10, 3)  # a slow step: the least count
    assert timed_steps(0.001) == (500, 50)  # half a second of millisecond steps
    assert timed_steps(1e-7) == (MOST_STEPS, MOST_STEPS // 10)  # never more than the cap
    assert timed_steps(0.01, least=15, seconds=0.3) == (30, 3)
    assert timed_steps(0.5, least=2000) == (2000, 200)  # an explicit least beats the cap
