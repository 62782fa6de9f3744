"""Each worker's program: what the runtime interprets is checked before any process starts."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.errors import ScheduleError
from netpart.models import ZOO
from netpart.partition import Granularity, build_unit_graph, plan
from netpart.partition.schedule import Instruction, build_schedule, check_program
from tests.conftest import small_specs


def _schedule(spec, workers, method="metis"):
    p = plan(spec, workers, method, granularity=Granularity(spatial_blocks=8, dense_blocks=4))
    return build_schedule(build_unit_graph(spec, p.granularity), p.node_map, workers)


@given(small_specs(), st.integers(1, 4), st.sampled_from(["metis", "random", "stripe"]))
@settings(max_examples=40, deadline=None)
def test_every_program_is_well_formed_and_its_messages_are_the_schedule(spec, workers, method):
    sched = _schedule(spec, workers, method)
    sched.validate()
    for w in range(workers):
        program = sched.instructions(w)
        check_program(program, len(spec.layers), w)
        computed = [(i.layer, i.phase) for i in program if i.op == "compute"]
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
        }  # noqa: E501
        assert {k: v for k, v in sends.items() if k[1] == "forward"} == want


def _broken(program, k, **change):
    out = list(program)
    out[k] = dataclasses.replace(out[k], **change)
    return tuple(out)


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
        "not an instruction of this model": _broken(program, 0, op="jump"),
    }
    for message, bad in cases.items():
        with pytest.raises(ScheduleError, match=message):
            check_program(bad, layers, 0)
    check_program(program, layers, 0)  # the real one passes
