"""The one timing helper: warm-ups are untimed, means and each call's figures are what was
spent, and alternated rounds reverse their order every other round."""

import time

import pytest

from netpart import timing


def test_mean_call_warms_then_times_back_to_back_calls():
    calls = []
    timed = timing.mean_call(lambda: (calls.append(1), time.sleep(0.01)), 3, warm=2)
    assert len(calls) == 5
    assert 0.01 <= timed.seconds < 0.5 and 0 <= timed.cpu < timed.seconds


def test_each_call_times_every_call_after_its_warm_up_and_runs_before_untimed():
    order = []
    runs = timing.each_call(
        lambda: (order.append("call"), time.sleep(0.005)),
        2,
        warm=1,
        before=lambda: (order.append("before"), time.sleep(0.05)),
    )
    assert order == ["before", "call"] * 3
    assert len(runs) == 2 and all(0.005 <= r.seconds < 0.05 for r in runs)


def test_thread_cpu_leaves_other_threads_out():
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        mine = timing.time_call(lambda: time.sleep(0.05), thread=True)[0]
    finally:
        stop.set()
        spinner.join()
    assert mine.cpu < 0.02 <= mine.seconds


def test_alternate_reverses_the_order_every_other_round_and_keeps_measured_floats():
    order = []
    rounds = timing.alternate(
        {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), 0.25)[1]},
        rounds=3,
        warm=1,
    )
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert rounds.seconds["b"] == [0.25] * 3  # what the case measured itself
    assert rounds.ratio("b") == pytest.approx(0.25 / rounds.median("a"))
    assert rounds.round_ratios("b", "a") == [0.25 / s for s in rounds.seconds["a"]]
    assert set(rounds.to_dict()["cases"]) == {"a", "b"} and rounds.probe["a"] == [0.0] * 3
