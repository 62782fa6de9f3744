"""A model worker's client of the shards, over a scripted process group: the messages it
posts, and how it reads the answers."""

import pytest
import torch

from netpart.compile.shards import ShardLayout
from netpart.errors import ProtocolError
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.ps import protocol
from netpart.ps.client import ShardClient
from tests.ps.fakes import Done

K = protocol.Kind


class _Shards:
    """A process group whose shards answer with `replies[src]` (in order) and record what
    they were sent."""

    def __init__(self, replies=None):
        self.replies = {src: list(r) for src, r in (replies or {}).items()}
        self.sent = []

    def recv(self, tensors, src, tag):
        def land():
            message = self.replies[src].pop(0)
            tensors[0].view(-1)[: message.numel()].copy_(message.view(-1))

        return Done(land)

    def send(self, tensors, dst, tag):
        self.sent.append((dst, tag, tensors[0]))
        return Done()


def _layout(shards):
    spec = load_spec("tiny-mlp")
    p = plan(spec, 1, "metis")
    return ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, 1, shards)


def _client(layout, group, **kw):
    ranks = [10 + s for s in range(layout.shards)]
    return ShardClient(
        layout,
        worker=0,
        replica=1,
        rank=3,
        shard_ranks=ranks,
        dtype=torch.float64,
        group=group,
        **kw,
    )


def _params(shard, version, values, kind=K.PARAMS):
    """A shard's combined reply [header | values]."""
    msg = protocol.request_buffer(values.numel(), torch.float64)
    protocol.write_header(msg, int(kind), 10 + shard, shard, version, values.numel(), 1, 0)
    protocol.values_of(msg, torch.float64, values.numel()).copy_(values)
    return msg


def test_a_push_from_a_push_buffer_goes_out_where_it_lies_with_its_header():
    layout = _layout(1)
    group = _Shards()
    client = _client(layout, group)
    (grads,) = client.push_buffers(1)
    grads.copy_(torch.arange(float(grads.numel())))
    client.complete(client.request(5, grads))
    ((dst, tag, msg),) = group.sent
    head = protocol.read_header(msg)
    assert (dst, tag) == (10, protocol.TAG_HEADER)
    assert head == [K.PUSH, 3, 0, 5, layout.total, 1, -1]  # no fetch yet: no version
    values = protocol.values_of(msg, torch.float64, layout.total)
    assert values.data_ptr() == grads.data_ptr()  # no copy: the buffer itself


def test_a_fetch_gathers_each_shards_values_into_the_workers_order():
    layout = _layout(2)
    size = layout.worker_size(0)
    want = torch.arange(float(size), dtype=torch.float64)
    replies = {}
    for s, segments in layout.routes(0).items():
        part = torch.cat([want[g.local_lo : g.local_lo + g.length] for g in segments])
        replies[10 + s] = [_params(s, 4 + s, part)]
    client = _client(layout, _Shards(replies))
    got = client.complete(client.request(0, fetch=True))
    assert torch.equal(got, want) and client.version == 4 and client.received == size


def test_a_shard_that_answers_current_sends_no_values_and_the_client_says_which():
    layout = _layout(2)
    segments = layout.routes(0)
    replies = {10: [_params(0, 9, torch.zeros(0), kind=K.CURRENT)]}
    part = torch.ones(sum(g.length for g in segments[1]), dtype=torch.float64)
    replies[11] = [_params(1, 9, part)]
    client = _client(layout, _Shards(replies), local_steps=True)
    ticket = client.request(0, fetch=True)
    assert client.complete(ticket) is not None and ticket.current == (0,)
    assert client.current_ranges(ticket) == [
        (g.local_lo, g.local_lo + g.length) for g in segments[0]
    ]
    assert client.received == part.numel()


def test_a_reply_that_does_not_fit_the_layout_is_refused_naming_the_shard():
    layout = _layout(1)
    wrong = _params(0, 1, torch.zeros(3))  # 3 values where the layout says more
    client = _client(layout, _Shards({10: [wrong]}))
    with pytest.raises(ProtocolError, match="bad reply from shard 0"):
        client.complete(client.request(0, fetch=True))


def test_a_slot_taken_back_drops_its_fetch_and_close_says_goodbye_to_every_shard():
    layout = _layout(2)
    replies = {10 + s: [] for s in range(2)}
    for s, segments in layout.routes(0).items():
        n = sum(g.length for g in segments)
        replies[10 + s] += [_params(s, v, torch.full((n,), float(v))) for v in (1, 2, 3)]
    group = _Shards(replies)
    client = _client(layout, group, depth=2)
    first = client.request(1, fetch=True)
    client.complete(client.request(2, fetch=True))  # now held: the next request takes first's
    third = client.request(3, fetch=True)
    assert client.complete(first) is None and first.dropped  # its slot was needed again
    assert bool((client.complete(third) == 3.0).all())
    client.close()
    byes = [(dst, protocol.read_header(msg)[0]) for dst, _, msg in group.sent[-2:]]
    assert byes == [(10, K.BYE), (11, K.BYE)]
