"""Each mode's policy on its own: told what arrived and shown a view of the bookkeeping, it
answers with a `Response` and touches nothing else."""

from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from netpart.compile.shards import Segment
from netpart.ps.lbfgs_vectors import ShardVectors
from netpart.ps.modes import Downpour, Push, Sandblaster, Sync
from netpart.ps.protocol import Op
from netpart.ps.rules import DelayCompensation

SEGMENTS = (Segment(0, 2, 3), Segment(3, 7, 2))  # 5 values: shard offsets 2..4 and 7..8


def _view(replicas=2, workers=(0, 1), lost=(), done=(), pushed=None, clock=0, updates=0):
    """A read-only view of bookkeeping, as the server hands it to its mode."""
    pushed = pushed or {(r, w): 0 for r in range(replicas) for w in workers}
    return SimpleNamespace(
        shard=0,
        replicas=replicas,
        workers=workers,
        size=10,
        values=torch.zeros(10),
        lost=MappingProxyType(dict.fromkeys(lost, "gone")),
        done=frozenset(done),
        pushed=MappingProxyType(pushed),
        clock=clock,
        updates=updates,
    )


def test_downpour_asks_for_the_whole_push_through_its_segments_as_one_update():
    mode = Downpour()
    values = torch.arange(1.0, 6.0)
    chunks = [(0, values[:4]), (4, values[4:])]  # the push as it landed: two chunks
    response = mode.pushed(_view(updates=3), Push(0, 1, 5, 3, SEGMENTS), chunks)
    assert response.updates == 1 and response.clock is None
    got = {at: grad.tolist() for at, grad in response.apply}
    assert got == {2: [1.0, 2.0, 3.0], 7: [4.0], 8: [5.0]}
    assert mode.current(0, 1) == 4 and mode.current(0, 1) is None  # alone: told once
    mode.pushed(_view(updates=4), Push(1, 1, 1, 2, SEGMENTS), chunks)  # computed on 2, now 4
    assert mode.current(1, 1) is None


def test_downpour_compensates_a_push_by_the_values_served():
    lam = 0.5
    mode = Downpour(DelayCompensation(lam))
    then = torch.zeros(5)
    mode.served(0, 0, 0, then)  # version 0 served to (0, 0)
    view = _view(updates=1)
    view.values[2:5] = 1.0  # the shard moved since
    g = torch.full((5,), 2.0)
    (at, grad), *_ = mode.pushed(view, Push(0, 0, 1, 0, SEGMENTS), [(0, g)]).apply
    assert at == 2 and torch.equal(grad, torch.full((3,), 2.0 + lam * 4 * 1.0))


def test_downpour_warm_start_answers_a_fetch_once_replica_0_pushed_the_step():
    mode = Downpour()
    assert mode.ready(_view(), 1, 0) and not mode.ready(_view(), 1, 3)
    pushed = {(0, 0): 3, (0, 1): 3, (1, 0): 0, (1, 1): 0}
    assert mode.ready(_view(pushed=pushed), 1, 3)
    assert mode.ready(_view(lost=(0,)), 1, 3)  # replica 0 gone: nothing to wait for
    assert mode.ready(_view(done=((0, 0), (0, 1))), 1, 3)


def test_sync_applies_each_step_once_every_live_replica_pushed_it():
    mode = Sync()
    view = _view(replicas=2, workers=(0,), updates=0)
    one = Push(0, 0, 1, -1, (Segment(0, 0, 10),))
    mode.fold(view, one, torch.ones(10), 0, 10)
    assert mode.pushed(view, one, None).apply == []  # replica 1 has not pushed step 1
    two = Push(1, 0, 1, -1, (Segment(0, 0, 10),))
    mode.fold(view, two, torch.full((10,), 3.0), 0, 10)
    response = mode.pushed(view, two, None)
    assert response.clock == 1 and response.updates == 1
    ((at, mean),) = response.apply
    assert at == 0 and torch.equal(mean, torch.full((10,), 2.0))
    assert not mode.ready(view, 0, 1)  # the view still says clock 0: applied by the server
    assert mode.ready(_view(replicas=2, workers=(0,), clock=1), 0, 1)


def test_sync_never_applies_past_the_step_a_stopped_replica_reached():
    mode = Sync()
    pushed = {(0, 0): 2, (1, 0): 1}
    view = _view(workers=(0,), done=((1, 0),), pushed=pushed, clock=1)
    push = Push(0, 0, 2, -1, (Segment(0, 0, 10),))
    mode.fold(view, push, torch.ones(10), 0, 10)
    assert mode.last_step(view) == 1
    assert mode.pushed(view, push, None).apply == []  # step 2: replica 1 stopped at 1
    assert mode.ready(view, 0, 2)  # answered as it stands


def test_sandblaster_adds_each_unit_part_once_and_waits_for_them_all():
    vectors = ShardVectors(torch.zeros(10, dtype=torch.float64), history=2)
    mode = Sandblaster(vectors, workers=(0, 1), timeout=5.0)
    view = _view()
    assert mode.command(view, Op.BEGIN, (7.0, 0, 0, 0), now=0.0).value == 0.0
    part = (Segment(0, 0, 10),)
    g = torch.ones(10, dtype=torch.float64)
    mode.pushed(view, Push(0, 0, 0, 7, part), [(0, g)])
    mode.pushed(view, Push(1, 0, 0, 7, part), [(0, g)])  # a backup copy: dropped
    mode.pushed(view, Push(0, 0, 1, 6, part), [(0, g)])  # an older evaluation: dropped
    assert mode.duplicates == 2 and torch.equal(vectors.vectors["g"], g)
    assert mode.command(view, Op.WAIT, (1.0, 0, 0, 0), now=1.0).value is None  # ask again
    assert mode.command(view, Op.WAIT, (1.0, 0, 0, 0), now=7.0).value == 1.0  # timed out
    mode.pushed(view, Push(0, 1, 0, 7, part), [(0, g)])
    done = mode.command(view, Op.WAIT, (1.0, 0, 0, 0), now=8.0)
    assert done.value == 0.0 and done.updates == 1
    assert mode.command(view, Op.DOT, (0.0, 1, 1, 0), now=9.0).value == pytest.approx(40.0)
