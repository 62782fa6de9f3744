"""Each worker's program: what the runtime interprets is checked before any process starts."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.compile.program import Instruction, check_program, parse_program, program_text
from netpart.compile.schedule import build_schedule
from netpart.errors import ScheduleError
from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph, plan
from tests.conftest import chain_specs, small_specs


def _schedule(spec, workers, method="metis", split_min_flops=0.0):
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    graph = build_unit_graph(spec, p.granularity)
    return build_schedule(graph, p.node_map, workers, split_min_flops=split_min_flops)


@given(small_specs(), st.integers(1, 4), st.sampled_from(["metis", "random", "stripe"]))
@settings(max_examples=40, deadline=None)
def test_every_program_is_well_formed_and_its_messages_are_the_schedule(spec, workers, method):
    sched = _schedule(spec, workers, method)
    sched.validate()
    for w in range(workers):
        program = sched.instructions(w)
        check_program(program, len(spec.layers), w)
        computed = list(dict.fromkeys((i.layer, i.phase) for i in program if i.op == "compute"))
        layers = range(len(spec.layers))
        assert computed == [(i, "forward") for i in layers] + [
            (i, "backward") for i in reversed(layers)
        ]
        sends = {(i.layer, i.phase, i.peer): i.count for i in program if i.op == "send"}
        want = {
            (lay, "forward", d): len(u)
            for lay, m in enumerate(sched.sends)
            for (s, d), u in m.items()
            if s == w
        }
        assert {k: v for k, v in sends.items() if k[1] == "forward"} == want


def _broken(program, k, **change):
    out = list(program)
    out[k] = dataclasses.replace(out[k], **change)
    return tuple(out)


@given(chain_specs(), st.integers(1, 4), st.sampled_from(["metis", "random", "tiles"]))
@settings(max_examples=30, deadline=None)
def test_a_program_prints_as_text_and_parses_back(spec, workers, method):
    """Every instruction of every worker's program is a token that parses back to it."""
    sched = _schedule(spec, workers, method)
    for w in range(workers):
        program = sched.instructions(w)
        text = program_text(program)
        assert parse_program(text) == program and len(text.splitlines()) == len(program)
        assert all(Instruction.from_str(str(i)) == i for i in program)
    assert str(Instruction("compute", 3, part="interior")) == "C3F.interior"
    assert str(Instruction("send", 2, "backward", peer=1, count=1920)) == "S2B>1*1920"
    for bad in ("C3F", "S2F<1*3", "L3F", "X1F", "R2F<1", "W2F.all", "C3F.sideways"):
        with pytest.raises(ScheduleError):
            Instruction.from_str(bad)


def test_a_program_out_of_order_is_refused():
    spec = ZOO["tiny-local"]
    sched = _schedule(spec, 2)
    program = sched.instructions(0)
    layers = len(spec.layers)
    wait = next(k for k, i in enumerate(program) if i.op == "wait")
    swapped = list(program)
    swapped[wait], swapped[wait + 1] = swapped[wait + 1], swapped[wait]  # compute before wait
    cases = {
        "before its halo has arrived": tuple(swapped),
        "waits for nothing posted, or twice": program[:wait]
        + program[wait:][:1] * 2
        + program[wait + 1 :],
        "ends before its backward pass": program[:-1],
        "the loss before the whole forward pass": (program[0], Instruction("loss", layers - 1)),
        "a part computed twice": program[:1] + program[:1] + program[1:],
        "not an instruction of this model": _broken(program, 0, layer=layers),
    }
    for message, bad in cases.items():
        with pytest.raises(ScheduleError, match=message):
            check_program(bad, layers, 0)
    with pytest.raises(ScheduleError, match="not an instruction of this model"):
        _broken(program, 0, op="jump")  # the vocabulary is typed: refused as it is written
    check_program(program, layers, 0)  # the real one passes


def test_overlap_programs_split_what_they_can_and_join_what_exchanges_nothing():
    spec = ZOO["tiny-local"]  # local pool lcn local dense
    sched = _schedule(spec, 2, "tiles")
    parts = {(i.layer, i.phase): set() for i in sched.instructions(0)}
    for i in sched.instructions(0):
        if i.op == "compute":
            parts[(i.layer, i.phase)].add(i.part)
    for layer in (0, 1):  # a producer chain: what worker 1 reads at layer 2 is computed first
        assert parts[(layer, "forward")] == parts[(layer, "backward")] == {"early", "late"}
    alone = _schedule(spec, 1, "tiles")  # a lone worker joins every layer to the one below
    assert [i.part for i in alone.instructions(0) if i.op == "compute"] == (
        ["all"] + ["joined"] * 4 + ["through"] * 4 + ["all"]
    )
    assert parts[(3, "forward")] == {"interior", "boundary"}
    assert parts[(3, "backward")] == {"input", "weights"}
    assert parts[(4, "forward")] == {"all"}  # a dense layer reads every unit: never split
    small = _schedule(spec, 2, "tiles", split_min_flops=1e9)  # too little work to split
    assert {i.part for i in small.instructions(0) if i.op == "compute"} == {"all"}
    plain = dataclasses.replace(sched, overlap=False)
    assert all(i.part == "all" for i in plain.instructions(0) if i.op == "compute")
    for bad_part, at in (("joined", 3), ("through", 3)):  # layer 3 has messages
        program = plain.instructions(0)
        k = next(k for k, i in enumerate(program) if i.op == "compute" and i.layer == at)
        phase = program[k].phase
        with pytest.raises(ScheduleError, match=r"joined|through|messages"):
            check_program(
                _broken(program, k, part=bad_part if phase == "forward" else "through"), 5, 0
            )


def test_a_producer_chain_posts_its_halo_between_its_parts_and_is_checked():
    """Worker 0 computes the units worker 1 reads (layers 0-1), posts them, then the rest;
    backward, the rest before the peer's gradients arrive. Out of order, it is refused."""
    spec = ZOO["tiny-local"]
    sched = _schedule(spec, 2, "tiles")
    program = sched.instructions(0)
    at = {(i.op, i.layer, i.phase, i.part): k for k, i in enumerate(program)}
    assert at[("compute", 1, "forward", "early")] < at[("send", 2, "forward", "all")]
    assert at[("send", 2, "forward", "all")] < at[("compute", 0, "forward", "late")]
    assert at[("compute", 0, "backward", "late")] < at[("wait", 2, "backward", "all")]
    assert at[("wait", 2, "backward", "all")] < at[("compute", 1, "backward", "early")]
    early = [k for k, i in enumerate(program) if i.part == "early" and i.phase == "forward"]
    send = at[("send", 2, "forward", "all")]
    cases = {
        "sends values it has not computed": program[send : send + 1]
        + program[:send]
        + program[send + 1 :],
        "the gradient of its outputs is not complete yet": _broken(
            program, at[("compute", 1, "backward", "late")], part="early"
        )[: at[("compute", 1, "backward", "late")] + 1],
        "parts of two different splits": _broken(program, early[0] + 4, part="boundary"),
    }
    for message, bad in cases.items():
        with pytest.raises(ScheduleError, match=message):
            check_program(bad, len(spec.layers), 0)
    bad_early = tuple(
        (row[0][:1], *row[1:]) if k == 1 else row for k, row in enumerate(sched.early)
    )
    with pytest.raises(ScheduleError, match="computes late"):
        dataclasses.replace(sched, early=bad_early).validate()


@given(
    chain_specs(),
    st.integers(2, 4),
    st.sampled_from(["metis", "random", "tiles"]),
    st.sampled_from([8, 64, 256]),  # many blocks: channel groups, split between workers
)
@settings(max_examples=60, deadline=None)
def test_chains_split_conv_and_local_layers_by_whole_positions(spec, workers, method, blocks):
    """A conv or local slice computes a position's channels in one matmul, so a producer
    chain's early units there hold every owned unit of each of their positions."""
    grain = Granularity(spatial_blocks=blocks, dense_blocks=4)
    p = plan(spec, workers, method, granularity=grain)
    graph = build_unit_graph(spec, p.granularity)
    schedule = build_schedule(graph, p.node_map, workers, split_min_flops=0.0)
    for layer, per_worker in enumerate(schedule.early):
        if spec.layers[layer].kind not in ("conv", "local"):
            continue
        plane = spec.shapes[layer].height * spec.shapes[layer].width
        for w, early in enumerate(per_worker):
            mine = schedule.owned[layer][w]
            assert set(mine[np.isin(mine % plane, early % plane)]) == set(early)
