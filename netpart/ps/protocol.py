"""The parameter server's wire protocol: message kinds, headers, tags and push chunks.

Every byte moves over torch.distributed point-to-point on the default (world) process group;
nothing is pickled. A header is int64 `[kind, sender, shard, step, length, replica, extra]`.
Payload lengths both sides know from the `ShardLayout` (worker w's message to shard s carries
exactly the segments of w's flat parameter vector that s holds). `extra`: of a push, the shard
version its gradient was computed on (Sandblaster: the evaluation); of a PARAMS reply, the
staleness of that peer's last applied push (-1: none yet); of a BYE, DIVERGED when the
worker leaves because its loss was not finite (its `step`: that step), and the shards then
keep their last checkpoint. The `step` of a FETCH: answer once
that step is applied (0: at once); a PUSH_FETCH's answer waits as its mode says (sync: for the
step pushed; otherwise not at all).

A worker's request is ONE message, raw bytes `[header | the first CHUNK values of the push, if
any]` (values from byte `VALUES_AT`): the shard receives every request into one buffer sized
for a push and reads its kind from the header; the push's further chunks follow on their own
tags. A PUSH_FETCH applies the push and answers with the values. A reply is one message
`[header | values]` when the values fit in one chunk (`combined_reply`), else a header and the
values. So a Downpour step of a small model is two messages, not five.

A worker that applies its own pushes to its parameters (Downpour's local steps) sends
PUSH_FETCH_LOCAL instead: when no update but its own came between the values its push was
computed on and the push, the shard's values equal the worker's, and the answer is a CURRENT
header alone (followed by an empty payload message where a separate one was expected), with
the version after the push: no values are copied or sent. Its fetches alone are FETCH_LOCAL,
answered CURRENT when the shard's version is still the one the worker's values hold (the
push header's version: the values fetched plus its own pushes since).

One tag space for the default group (halo exchanges use each replica's own group):

    TAG_HEADER      1   requests (worker -> shard) and reply headers; coordinator commands
    TAG_PAYLOAD     2   reply values and commands' arguments and answers
    TAG_UNIT        3   coordinator -> a replica's workers: a work unit, or goodbye
    TAG_DONE        4   worker 0 of a replica -> coordinator: a unit is done (header)
    TAG_DONE_VALUE  5   ... and its loss sum
    TAG_CHUNK + i  16+  chunk i >= 1 of a push (CHUNK values each; any number of chunks)

Fixed tags stay below TAG_CHUNK, so no push, however long, reuses one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

from netpart.compile.shards import Segment

__all__ = [
    "CHUNK",
    "DIVERGED",
    "HEADER_BYTES",
    "HEADER_LEN",
    "TAG_CHUNK",
    "TAG_DONE",
    "TAG_DONE_VALUE",
    "TAG_HEADER",
    "TAG_PAYLOAD",
    "TAG_UNIT",
    "VALUES_AT",
    "Kind",
    "Op",
    "chunks",
    "combined_reply",
    "header",
    "later_chunks",
    "overlaps",
    "post_chunks",
    "read_header",
    "request_buffer",
    "segments_length",
    "values_of",
    "write_header",
]

HEADER_LEN = 7
HEADER_BYTES = 8 * HEADER_LEN
VALUES_AT = 64  # where values start in a [header | values] message: a cache line's start
TAG_HEADER, TAG_PAYLOAD, TAG_UNIT, TAG_DONE, TAG_DONE_VALUE = 1, 2, 3, 4, 5
TAG_CHUNK = 16
CHUNK = 1 << 18  # values per push chunk
DIVERGED = 1  # a BYE's `extra`: the worker's loss was not finite


class Kind(IntEnum):
    PUSH = 1
    FETCH = 2
    PARAMS = 3
    BYE = 4
    CMD = 5  # Sandblaster: coordinator -> shard, a vector operation
    REPLY = 6  # shard -> coordinator: its result
    UNIT = 7  # coordinator -> worker: compute this work unit
    DONE = 8  # worker 0 of a replica -> coordinator: unit finished, with its loss sum
    PUSH_FETCH = 9  # worker -> shard: apply this push, then answer with the values
    PUSH_FETCH_LOCAL = 10  # ... or CURRENT if nothing but the sender's own pushes changed them
    CURRENT = 11  # shard -> worker: your values (with your pushes applied) are the shard's
    FETCH_LOCAL = 12  # a FETCH answered CURRENT if the shard is still at version `extra`


class Op(IntEnum):
    """Sandblaster's shard operations (`Kind.CMD`; args float64 [alpha, a, b, c])."""

    DOT = 1
    ABS_SUM = 2
    ABS_MAX = 3
    AXPY = 4
    COPY = 5
    SCALE = 6
    DIFF = 7
    KEEP_PAIR = 8
    BEGIN = 9  # a new evaluation: zero the batch gradient, forget the units received
    WAIT = 10  # answer once every worker's part of `alpha` units has arrived
    STOP = 11


def header(
    kind: Kind, sender: int, shard: int, step: int, length: int, replica: int, extra: int = -1
) -> torch.Tensor:
    return torch.tensor([int(kind), sender, shard, step, length, replica, extra], dtype=torch.int64)


def request_buffer(length: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes for one request carrying up to the first chunk of a `length`-value push."""
    first = min(length, CHUNK)
    return torch.zeros(VALUES_AT + first * dtype.itemsize, dtype=torch.uint8)


def write_header(buf: torch.Tensor, *fields: int) -> None:
    """Put [kind, sender, shard, step, length, replica, extra] in a message's first bytes
    (through a numpy view: a microsecond, where building a tensor costs several)."""
    buf.numpy()[:HEADER_BYTES].view(np.int64)[:] = fields


def read_header(buf: torch.Tensor) -> list[int]:
    """[kind, sender, shard, step, length, replica, extra] from a message's first bytes."""
    return buf.numpy()[:HEADER_BYTES].view(np.int64).tolist()


def values_of(buf: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The `count` values that follow the header in message bytes `buf` (from `VALUES_AT`:
    parameters that become views of fetched values are aligned like any tensor)."""
    size = dtype.itemsize
    return buf[VALUES_AT : VALUES_AT + count * size].view(dtype)


def combined_reply(length: int) -> bool:
    """Whether a reply of `length` values travels in one message with its header."""
    return length <= CHUNK


def segments_length(segments: tuple[Segment, ...]) -> int:
    return sum(s.length for s in segments)


def chunks(n: int) -> list[tuple[int, int]]:
    """[a, b) ranges of a push payload of n values, CHUNK values each (the last shorter)."""
    cuts = [*range(0, n, CHUNK), n]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a] or [(0, 0)]


def later_chunks(n: int) -> list[tuple[tuple[int, int], int]]:
    """((a, b), tag) of the chunks of an n-value push after the first (which travels in the
    request)."""
    return [((a, b), TAG_CHUNK + i) for i, (a, b) in enumerate(chunks(n)) if i > 0]


def post_chunks(
    group: dist.ProcessGroup, payload: torch.Tensor, src: int
) -> list[tuple[tuple[int, int], dist.Work]]:
    """Post the receives of a push's chunks after the first (which came in the request) into
    `payload`, on `group`: ((a, b), work) per chunk."""
    return [
        ((a, b), group.recv([payload[a:b]], src, tag))
        for (a, b), tag in later_chunks(payload.numel())
    ]


def overlaps(segments: tuple[Segment, ...], a: int, b: int) -> Iterator[tuple[int, int, int]]:
    """(payload lo, payload hi, shard offset) of the parts of `segments` in payload [a, b)."""
    off = 0
    for seg in segments:
        lo, hi = max(a, off), min(b, off + seg.length)
        if lo < hi:
            yield lo, hi, seg.shard_lo + lo - off
        off += seg.length
