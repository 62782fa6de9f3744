"""The calibration's parameter-server tables from a runner's `ps` (a scripted runner): which
configurations it measures for the machines it has, each size's repeats, and the tables'
keys and busy time as the profile's `ps` holds them; their passes, where a calibration puts
them, and each size's median over them; the all-reduce it asks for last, and its tables."""

import pytest

from netpart.calibrate.pstables import (
    AFTER_SIZES,
    PS_PASSES,
    PS_REPEATS,
    PS_SIZES,
    STAND_IN_S,
    PsTables,
    per_size,
    ps_repeats,
    ps_sizes,
    ps_tables,
    ring_plan,
    with_rings,
)


class Runner:
    share = 0.5

    def __init__(self, machines: int) -> None:
        self.machines = machines
        self.calls: list[tuple] = []
        self.after: list[tuple] = []  # the calls with a stand-in step
        self.slow = 1.0  # the host's slowness, times every exchange's seconds

    def ps(self, mode, clients, sizes, repeats, shards=1, stand_in=0.0):
        if stand_in:
            self.after.append((mode, clients, shards, sizes, repeats, stand_in))
            return [stand_in / self.share + 1e-9 * b * clients for b in sizes], [0.0] * len(sizes)
        self.calls.append((mode, clients, shards, sizes, repeats))
        seconds = [self.slow * 1e-9 * b * (clients + 10 * shards) for b in sizes]
        return seconds, [1e-9 * b for b in sizes]


def test_every_pair_of_clients_and_shards_the_machines_allow():
    runner = Runner(machines=4)
    ps, raw = ps_tables(runner, lambda line: None, passes=1)
    configs = {(m, k, s) for m, k, s, _, _ in runner.calls}
    assert configs == {
        (m, k, s)
        for m in ("sync", "downpour")
        for k, s in ((1, 1), (2, 1), (3, 1), (1, 2), (1, 3), (2, 2))
    }
    for _, _, _, sizes, repeats in runner.calls:
        assert all(PS_REPEATS[PS_SIZES.index(b)] == repeats for b in sizes)
    assert set(raw["seconds"]["sync"]) == {"1", "2", "3"}
    assert set(raw["spread"]["downpour"]) == {"2", "3"}
    assert set(raw["mesh"]["sync"]) == set(raw["mesh_busy"]["downpour"]) == {"2x2"}
    assert raw["spread"]["sync"]["3"] == [1e-9 * b * 31 for b in PS_SIZES]  # in size order
    assert raw["spread_busy"]["sync"]["2"] == [2e-9 * b for b in PS_SIZES]  # CPU / share
    assert ps.spread_s("sync", 3, float(PS_SIZES[2])) == 1e-9 * PS_SIZES[2] * 31
    assert ps.exchange_s("sync", 2, 2, float(PS_SIZES[2])) == 1e-9 * PS_SIZES[2] * 22
    assert (ps.share, ps.quota_s) == (0.5, 0.001)  # a testbed's quota: 1 ms a period
    assert "allreduce" not in raw and not ps.allreduce  # timed last, out of every group
    assert "passes" not in raw  # one pass: the tables are it


def test_passes_share_the_repeats_and_the_tables_are_each_size_s_median():
    runner, said = Runner(machines=4), []
    tables = PsTables(runner, said.append, runs=5, passes=3)
    for slow in (1.0, 3.0, 2.0):  # the host, slower in the second pass than the third
        runner.slow = slow
        tables.time_pass()
    tables.time_pass()  # no fourth
    # 2 modes x 6 pairs a pass, a call per repeat count (10, 7, 3, 2)
    assert len(runner.calls) == 3 * 12 * 4
    for _, _, _, sizes, repeats in runner.calls:  # a third of each size's repeats, at least 2
        assert all(max(2, round(PS_REPEATS[PS_SIZES.index(b)] / 3)) == repeats for b in sizes)
    ps, raw = tables.result()
    assert len(runner.calls) == 3 * 12 * 4  # every pass was timed already
    assert raw["seconds"]["sync"]["2"] == [2.0 * 1e-9 * b * 12 for b in PS_SIZES]  # the median
    assert raw["busy"]["sync"]["2"] == [2e-9 * b for b in PS_SIZES]  # the same in every pass
    assert ps.exchange_s("sync", 2, 2, float(PS_SIZES[2])) == 2.0 * 1e-9 * PS_SIZES[2] * 22
    assert [p["mesh"]["downpour"]["2x2"][0] for p in raw["passes"]] == [
        slow * 1e-9 * PS_SIZES[0] * 22 for slow in (1.0, 3.0, 2.0)
    ]
    assert set(raw["passes"][0]) == {"seconds", "spread", "mesh"}  # wall-clock time only
    assert said[-1] == (
        "parameter server: each size's median of 3 passes; a pass read 0.50-1.50x it "
        "(10th-90th percentile; 0.50-1.50x at the extremes)"
    )


@pytest.mark.parametrize(
    ("passes", "rounds", "after"), [(3, 5, [2, 5]), (2, 5, [5]), (3, 1, [1]), (1, 5, [])]
)
def test_the_passes_after_the_first_fall_between_the_rounds_the_last_after_the_last(
    passes, rounds, after
):
    runner = Runner(machines=2)
    tables = PsTables(runner, lambda line: None, passes=passes)
    tables.time_pass()
    between, timed = tables.between_rounds(rounds), []
    for done in range(1, rounds + 1):
        calls = len(runner.calls)
        between(done)
        if len(runner.calls) > calls:
            timed.append(done)
    assert timed == after
    tables.result()  # times what is still due (one round: the third pass)
    assert sum(PS_SIZES[0] in sizes for *_, sizes, _ in runner.calls) == passes * 2  # modes


def test_a_runner_without_machines_of_its_own_has_no_tables():
    class Local:
        machines = 2

    tables = PsTables(Local(), lambda line: None)
    tables.time_pass()
    tables.between_rounds(5)(5)
    tables.time_after()
    assert tables.result() == (None, None)
    with pytest.raises(ValueError, match="passes 0"):
        PsTables(Local(), lambda line: None, passes=0)


def test_the_all_reduce_is_timed_last_at_the_tables_sizes_and_joins_them():
    _, raw = ps_tables(Runner(machines=4), lambda line: None, wire_bps=100e6, runs=10)
    plan = ring_plan(raw, 10)
    assert plan == {"sizes": list(PS_SIZES[:-1]), "repeats": [2 * n for n in PS_REPEATS[:-1]]}
    assert ring_plan(None) is None  # no machines of their own: no tables, no ring
    said: list[str] = []
    rings = {
        k: ([1e-9 * b * k for b in plan["sizes"]], [1e-9 * b for b in plan["sizes"]])
        for k in (2, 3, 4)
    }
    ps, joined = with_rings(raw, rings, said.append)
    assert joined["allreduce"]["3"] == [1e-9 * b * 3 for b in PS_SIZES[:-1]]
    assert joined["allreduce_busy"]["4"] == [1e-9 * b / 0.5 for b in PS_SIZES[:-1]]  # / share
    assert ps.allreduce_s(3, float(PS_SIZES[2])) == 1e-9 * PS_SIZES[2] * 3
    assert ps.seconds == ps_tables(Runner(machines=4), lambda line: None, wire_bps=100e6)[0].seconds
    assert "allreduce" not in raw  # the tables it was given are left as they were
    assert len(said) == 3 and said[0].startswith("all-reduce among 2 machines: 16 kB")


def test_too_few_machines_measure_no_client_of_several_shards_or_several_of_them():
    ps, raw = ps_tables(Runner(machines=2), lambda line: None)
    assert "spread" not in raw and "spread_busy" not in raw and not ps.spread
    ps, raw = ps_tables(Runner(machines=3), lambda line: None)
    assert set(raw["spread"]["sync"]) == {"2"} and "mesh" not in raw and not ps.mesh


def test_sizes_print_in_decimal_and_powers_of_two_in_kib():
    said = per_size([16_000, 65_536, 16_000_000, 40_000_000], [0.001, 0.002, 0.25, 0.6])
    assert said == "16 kB 1.00 ms, 64 KiB 2.00 ms, 16 MB 250.00 ms, 40 MB 600.00 ms"


def test_sizes_the_link_takes_seconds_over_are_not_timed():
    assert ps_sizes(1e9) == ps_sizes(0.0) == PS_SIZES  # 40 MB: 0.32 s on 1 Gbit/s
    assert ps_sizes(100e6) == PS_SIZES[:-1]  # 40 MB: 3.2 s; 16 MB: 1.28 s
    assert ps_sizes(1e6)[-1] == 4_000_000  # those up to 4 MB on any link
    assert ps_sizes(1e9, largest=16e6) == PS_SIZES[:-1]  # --ps-up-to 16MB
    assert ps_sizes(1e6, largest=1e6)[-1] == 1_000_000
    runner = Runner(machines=2)
    _, raw = ps_tables(runner, lambda line: None, wire_bps=100e6)
    assert raw["sizes"] == list(PS_SIZES[:-1]) and len(raw["seconds"]["sync"]["1"]) == 9
    assert {b for *_, sizes, _ in runner.calls for b in sizes} == set(PS_SIZES[:-1])


def test_fewer_runs_time_fewer_exchanges_and_never_fewer_than_two():
    assert [PsTables(Runner(2), lambda line: None, runs=r).passes for r in (1, 2, 5)] == [
        1,
        2,
        PS_PASSES,
    ]
    assert "passes" not in ps_tables(Runner(2), lambda line: None, runs=1)[1]  # one pass
    assert [ps_repeats(b) for b in PS_SIZES] == list(PS_REPEATS)
    assert [ps_repeats(b, 1) for b in PS_SIZES] == [6, 6, 6, 6, 6, 6, 4, 2, 2, 2]
    runner = Runner(machines=2)
    ps_tables(runner, lambda line: None, runs=10, passes=1)
    assert {(b, n) for *_, sizes, n in runner.calls for b in sizes} == {
        (b, 2 * n) for b, n in zip(PS_SIZES, PS_REPEATS, strict=True)
    }


def test_every_pair_is_timed_again_after_a_stand_in_step_at_a_few_sizes():
    runner = Runner(machines=4)
    ps, raw = ps_tables(runner, lambda line: None, wire_bps=100e6, runs=10)
    sizes = [b for b in AFTER_SIZES if b in PS_SIZES[:-1]]  # 40 MB: 3.2 s on 100 Mbit/s
    assert raw["after"]["sizes"] == sizes and raw["after"]["stand_in_s"] == STAND_IN_S
    pairs = {(k, s) for _, k, s, _, _ in runner.calls}
    assert {(m, k, s) for m, k, s, *_ in runner.after} == {
        (m, k, s) for m in ("sync", "downpour") for k, s in pairs
    }
    assert all(len(b) == 1 and n >= 2 and cpu == STAND_IN_S for *_, b, n, cpu in runner.after)
    assert set(raw["after"]["seconds"]["downpour"]) == {f"{k}x{s}" for k, s in pairs}
    want = STAND_IN_S / 0.5 + 1e-9 * sizes[1] * 3
    assert abs(ps.after_s("sync", 3, 1, float(sizes[1])) - want) < 1e-12
    assert ps.stand_in_s == STAND_IN_S
