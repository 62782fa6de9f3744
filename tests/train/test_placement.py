"""Placement of a job's roles on hosts: pure, property-tested."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netpart.train.placement import PlacementError, place


def test_pack_keeps_replicas_on_one_host_and_spreads_shards():
    hosts = ["a"] * 3 + ["b"] * 3  # torchrun: node 0 has ranks 0-2, node 1 ranks 3-5
    p = place(hosts, replicas=2, workers=2, shards=2)
    assert p.hosts_of_replica(0) == {"a"} and p.hosts_of_replica(1) == {"b"}
    assert {p.hosts[p.shard_rank(0)], p.hosts[p.shard_rank(1)]} == {"a", "b"}
    ordered = place(hosts, 2, 2, 2, "ordered")
    assert ordered.hosts_of_replica(1) == {"a", "b"}  # the naive order splits replica 1
    spread = place(hosts, 2, 2, 2, "spread")
    assert spread.hosts_of_replica(0) == {"a", "b"}
    with_coordinator = place([*hosts, "b"], 2, 2, 2, coordinators=1)
    assert with_coordinator.coordinator_rank() == 6 and with_coordinator.name(6) == "coordinator"
    assert with_coordinator.hosts_of_replica(0) == {"a"}
    one = place(["x"] * 6, 2, 2, 2)  # one machine: the documented rank arithmetic
    assert [one.worker_rank(r, w) for r in (0, 1) for w in (0, 1)] == [0, 1, 2, 3]
    assert one.shard_rank(1) == 5 and one.name(3) == "replica 1 worker 1"


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["pack", "spread", "ordered"]),
)
@settings(max_examples=200, deadline=None)
def test_every_policy_gives_each_role_exactly_one_rank(slots, replicas, workers, policy):
    hosts = [f"h{i}" for i, n in enumerate(slots) for _ in range(n)]
    shards = len(hosts) - replicas * workers
    if shards < 1:
        with pytest.raises(PlacementError, match="processes for a job"):
            place(hosts, replicas, workers, max(1, shards), policy)
        return
    p = place(hosts, replicas, workers, shards, policy)
    ranks = [p.worker_rank(r, w) for r in range(replicas) for w in range(workers)]
    ranks += [p.shard_rank(s) for s in range(shards)]
    assert sorted(ranks) == list(range(len(hosts)))
    if policy == "pack" and max(slots) >= workers * replicas:
        # Room for every replica on the biggest host: none is split.
        assert all(len(p.hosts_of_replica(r)) == 1 for r in range(replicas))
