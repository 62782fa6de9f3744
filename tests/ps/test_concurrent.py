"""No update lost or torn: R replica processes push known gradients to two shard processes at
once, through the real client (courier thread, pipelined requests, pushes of several chunks;
or, as with local steps, posted from the caller with CURRENT answers allowed), and every
shard's final values are exactly what the sum of all pushes makes them. In sync mode every
replica's fetch of step t shows exactly the values after step t."""

from __future__ import annotations

import pytest

from tests.ps.roles import run_roles

REPLICAS, SHARDS, STEPS, CHUNK = 3, 2, 40, 1000


def _job(tmp_path, mode: str, chunk: int, local: int = 0) -> list[dict]:
    """Every process's report: the replicas', then the shards' (`tests.ps.roles.concurrent`)."""
    args = ["concurrent", mode, *map(str, (REPLICAS, STEPS, chunk, local))]
    return run_roles(tmp_path, REPLICAS + SHARDS, args)


@pytest.mark.parametrize("local", [0, 1])
def test_concurrent_pushes_are_all_applied_whole(tmp_path, local):
    reports = _job(tmp_path, "downpour", CHUNK, local)
    pushed = sum((r + 1) * s for r in range(REPLICAS) for s in range(1, STEPS + 1))
    for rep in reports[:REPLICAS]:
        assert rep["torn"] == 0
    for rep in reports[REPLICAS:]:
        assert rep["updates"] == REPLICAS * STEPS  # none lost
        assert rep["distinct"] == [-float(pushed)]  # every value got every push, whole


@pytest.mark.parametrize("chunk", [CHUNK, 1 << 20])  # replies apart, and in one message
def test_sync_fetches_show_exactly_the_step_they_wait_for(tmp_path, chunk):
    reports = _job(tmp_path, "sync", chunk)
    assert [r["wrong"] for r in reports[:REPLICAS]] == [[]] * REPLICAS
    assert [r["updates"] for r in reports[REPLICAS:]] == [STEPS] * SHARDS
