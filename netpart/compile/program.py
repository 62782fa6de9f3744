"""A worker's program: the instructions the runtime interprets, and the check that it is sound.

`HaloSchedule.instructions(w)` writes worker w's program; `check_program` refuses, before any
process starts, a program that computes a layer before its input, uses a halo before waiting
for it, sends values it has not computed, mixes the parts of two different splits or ends with
a message in flight. Parts of a layer: forward, all | interior and boundary (the units that
read no halo, then the rest) | early and late (a producer chain's units its peers read, then
the rest) | joined; backward, all | input and weights | late and early | through.

The vocabulary is typed (`Op`, `Phase`, `Part`: strings too, so "forward" == Phase.FORWARD),
and an instruction prints as a short token that parses back (`Instruction.from_str`), as
torch `distributed/pipelining`'s `_Action` does: `C3F.interior` (compute layer 3 forward, its
interior), `S3F>1*1920` / `R3B<0*1920` (send to / receive from a peer, units per example),
`W3F` (wait), `L5` (the loss over layer 5). `program_text` and `parse_program` do a whole
program, one token per line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from netpart.errors import ScheduleError

__all__ = [
    "OPS",
    "PARTS",
    "Instruction",
    "Op",
    "Part",
    "Phase",
    "check_program",
    "halo_tag",
    "parse_program",
    "program_text",
]


class _Word(str, Enum):
    """A word of the vocabulary: equal to its string, printed as it."""

    def __str__(self) -> str:
        return self.value


class Op(_Word):
    COMPUTE = "compute"
    SEND = "send"
    RECV = "recv"
    WAIT = "wait"
    LOSS = "loss"


class Phase(_Word):
    FORWARD = "forward"
    BACKWARD = "backward"


class Part(_Word):
    ALL = "all"
    INTERIOR = "interior"  # forward: the owned units that read no halo
    BOUNDARY = "boundary"  # forward: the rest, once the halo is in
    JOINED = "joined"  # forward: all of it, reading the layer below in one autograd graph
    EARLY = "early"  # a producer chain's units its peers read
    LATE = "late"  # the chain's other units
    INPUT = "input"  # backward: the gradient w.r.t. the layer's input
    WEIGHTS = "weights"  # backward: the weight gradients
    THROUGH = "through"  # backward: nothing yet (a joined layer's flows on below)


OPS = tuple(Op)
PARTS = {
    Phase.FORWARD: (Part.ALL, Part.INTERIOR, Part.BOUNDARY, Part.JOINED, Part.EARLY, Part.LATE),
    Phase.BACKWARD: (Part.ALL, Part.INPUT, Part.WEIGHTS, Part.THROUGH, Part.LATE, Part.EARLY),
}
_WHOLE = {
    Phase.FORWARD: ({Part.ALL}, {Part.JOINED}),
    Phase.BACKWARD: ({Part.ALL}, {Part.THROUGH}),
}
_LETTER = {Op.COMPUTE: "C", Op.SEND: "S", Op.RECV: "R", Op.WAIT: "W", Op.LOSS: "L"}
_TOKEN = re.compile(
    r"(?P<op>[CSRWL])(?P<layer>\d+)(?P<phase>[FB])?"
    r"(?:\.(?P<part>[a-z]+)|(?P<way>[<>])(?P<peer>\d+)\*(?P<count>\d+))?"
)


def halo_tag(layer: int, phase: Phase) -> int:
    """The transport tag of layer `layer`'s messages in `phase` (one per direction)."""
    return 2 * layer + (phase == Phase.BACKWARD)


@dataclass(frozen=True)
class Instruction:
    """One step of a worker's program.

    compute: run `part` of layer `layer` in `phase` (forward parts: all | interior, the owned
    units that read no halo | boundary, the rest | joined, all of them, reading the layer
    below within one autograd graph; backward parts: all | input, the gradient w.r.t. the
    layer's input | weights | through, nothing yet: a joined layer's gradient flows on in
    the next backward computation). send/recv: post the (layer, phase) message to/from
    `peer`, `count` units per example (units of layer - 1). wait: complete every message of
    (layer, phase); a backward wait also adds the received gradients to the owned units'.
    loss: the loss over the output layer and its gradient. Strings are read as their words
    (ScheduleError for one that is not).
    """

    op: Op
    layer: int
    phase: Phase = Phase.FORWARD
    peer: int = -1
    count: int = 0
    part: Part = Part.ALL

    def __post_init__(self) -> None:
        for name, kind in (("op", Op), ("phase", Phase), ("part", Part)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                words = ", ".join(map(str, kind))
                raise ScheduleError(
                    f"{name} {value!r} is not an instruction of this model (one of {words})"
                ) from None

    def __str__(self) -> str:
        head = f"{_LETTER[self.op]}{self.layer}"
        if self.op == Op.LOSS:
            return head
        head += "F" if self.phase == Phase.FORWARD else "B"
        if self.op == Op.COMPUTE:
            return f"{head}.{self.part}"
        if self.op in (Op.SEND, Op.RECV):
            return f"{head}{'>' if self.op == Op.SEND else '<'}{self.peer}*{self.count}"
        return head

    @classmethod
    def from_str(cls, text: str) -> Instruction:
        """The instruction a token names (`str` of one); ScheduleError for anything else."""
        m = _TOKEN.fullmatch(text.strip())
        op = next((o for o, letter in _LETTER.items() if m and letter == m["op"]), None)
        if m is None or (op == Op.LOSS) != (m["phase"] is None):
            raise ScheduleError(f"not an instruction: {text!r}")
        if (op == Op.COMPUTE) != (m["part"] is not None) or (op in (Op.SEND, Op.RECV)) != (
            m["way"] == (">" if op == Op.SEND else "<")
        ):
            raise ScheduleError(f"not an instruction: {text!r}")
        phase = Phase.BACKWARD if m["phase"] == "B" else Phase.FORWARD
        peer, count = (int(m["peer"]), int(m["count"])) if m["way"] else (-1, 0)
        return cls(op, int(m["layer"]), phase, peer, count, m["part"] or Part.ALL)

    @property
    def tag(self) -> int:
        """The transport tag of a message (`halo_tag` of its layer and phase)."""
        return halo_tag(self.layer, self.phase)

    def describe(self) -> str:
        """The instruction in words (error messages)."""
        if self.op in (Op.SEND, Op.RECV):
            way = "to" if self.op == Op.SEND else "from"
            return f"{self.op} {self.phase} halo of layer {self.layer} {way} {self.peer}"
        if self.op == Op.COMPUTE:
            return f"compute layer {self.layer} {self.phase} ({self.part})"
        return "loss" if self.op == Op.LOSS else f"wait {self.phase} layer {self.layer}"


def program_text(program: tuple[Instruction, ...]) -> str:
    """A program as text: one instruction's token per line."""
    return "\n".join(map(str, program))


def parse_program(text: str) -> tuple[Instruction, ...]:
    """The program `program_text` wrote (blank lines ignored)."""
    return tuple(Instruction.from_str(line) for line in text.splitlines() if line.strip())


def check_program(
    program: tuple[Instruction, ...],
    layers: int,
    worker: int = 0,
    *,
    sources: tuple[tuple[int, ...], ...] | None = None,
) -> None:
    """Raise ScheduleError unless `program` (one worker's, for a model of `layers` layers
    whose layer l reads the layers `sources[l]`: the layer below by default) computes every
    layer forward and then backward exactly once, sends only what it has computed, uses a
    halo only after waiting for it, and ends with nothing in flight."""
    if sources is None:
        sources = tuple((i - 1,) if i else () for i in range(layers))
    check = _Checker(layers, worker, sources)
    for k, ins in enumerate(program):
        why = check(ins)
        if why is not None:
            raise ScheduleError(f"worker {worker}, instruction {k} ({ins.describe()}): {why}")
    if not all(_complete(b, Phase.BACKWARD) for b in check.bwd) or check.posted != check.waited:
        raise ScheduleError(f"worker {worker}: the program ends before its backward pass does")


def _complete(parts: set[Part], phase: Phase) -> bool:
    """Whether `parts` computed of a layer in `phase` make the whole of it."""
    return parts in _WHOLE[phase] or parts in ({Part.EARLY, Part.LATE}, set(PARTS[phase][1:3]))


class _Checker:
    """What a program did so far; called with each instruction, it says why that one may
    not come next (None: it may)."""

    def __init__(self, layers: int, worker: int, sources: tuple[tuple[int, ...], ...]) -> None:
        self.layers, self.worker = layers, worker
        self.sources = sources  # per layer: the layers it reads
        self.readers = tuple(
            tuple(r for r in range(layers) if i in sources[r]) for i in range(layers)
        )
        self.fwd: list[set[Part]] = [set() for _ in range(layers)]
        self.bwd: list[set[Part]] = [set() for _ in range(layers)]
        self.posted: set[tuple[int, Phase]] = set()
        self.waited: set[tuple[int, Phase]] = set()
        self.loss = False

    def __call__(self, ins: Instruction) -> str | None:
        if not 0 <= ins.layer < self.layers:
            return "not an instruction of this model"
        if ins.op == Op.COMPUTE:
            return self._compute(ins) or self._order(ins)
        if ins.op in (Op.SEND, Op.RECV):
            return self._message(ins)
        if ins.op == Op.WAIT:
            key = (ins.layer, ins.phase)
            if key not in self.posted or key in self.waited:
                return "waits for nothing posted, or twice"
            self.waited.add(key)
            return None
        if self.loss or not all(_complete(f, Phase.FORWARD) for f in self.fwd):
            return "the loss before the whole forward pass, or twice"
        self.loss = True
        return None

    def _compute(self, ins: Instruction) -> str | None:
        """Whether the part fits the parts of the layer computed so far."""
        done = (self.fwd if ins.phase == Phase.FORWARD else self.bwd)[ins.layer]
        if ins.part not in PARTS[ins.phase] or ins.part in done or Part.ALL in done:
            return "an unknown part, or a part computed twice"
        if ins.part in (Part.ALL, Part.JOINED, Part.THROUGH) and done:
            return "the whole layer after a part of it"
        if done and {ins.part, *done} not in ({Part.EARLY, Part.LATE}, set(PARTS[ins.phase][1:3])):
            return "parts of two different splits"
        if ins.part in (Part.JOINED, Part.THROUGH) and (
            not ins.layer or (ins.layer, ins.phase) in self.posted
        ):
            return "a layer joined to the one below has no messages"
        if ins.part == Part.THROUGH and Part.JOINED not in self.fwd[ins.layer]:
            return "flows through a layer that was not joined"
        halves = ins.part in (Part.LATE, Part.EARLY)
        if ins.phase == Phase.BACKWARD and halves != (
            self.fwd[ins.layer] == {Part.EARLY, Part.LATE}
        ):
            return "backward parts unlike its forward parts (early and late)"
        return None

    def _order(self, ins: Instruction) -> str | None:
        """Whether what the part reads is computed (and in) yet; if so it is done."""
        if ins.phase == Phase.FORWARD:
            if self.loss or not self._input_ready(ins.layer, ins.part):
                return "its input is not computed yet"
            reads_halo = ins.part not in (Part.INTERIOR, Part.JOINED)
            if reads_halo and not self._halo_in(ins.layer, Phase.FORWARD):
                return "before its halo has arrived"
            self.fwd[ins.layer].add(ins.part)
            return None
        if not self.loss or not self._grad_ready(ins.layer, ins.part):
            return "the gradient of its outputs is not complete yet"
        self.bwd[ins.layer].add(ins.part)
        return None

    def _message(self, ins: Instruction) -> str | None:
        key = (ins.layer, ins.phase)
        joined = {Part.JOINED, Part.THROUGH} & (self.fwd[ins.layer] | self.bwd[ins.layer])
        if ins.layer == 0 or key in self.waited or ins.peer == self.worker or ins.count <= 0:
            return "a message outside the exchange of its layer"
        if joined:
            return "a message outside the exchange of its layer"
        below = [self.fwd[s] for s in self.sources[ins.layer]]
        computed = (
            all(_complete(b, Phase.FORWARD) or Part.EARLY in b for b in below)
            if ins.phase == Phase.FORWARD
            else {Part.ALL, Part.INPUT} & self.bwd[ins.layer]
        )
        if ins.op == Op.SEND and not computed:
            return "sends values it has not computed"
        self.posted.add(key)
        return None

    def _halo_in(self, layer: int, phase: Phase) -> bool:
        return (layer, phase) not in self.posted or (layer, phase) in self.waited

    def _input_ready(self, layer: int, part: Part) -> bool:
        below = [self.fwd[s] for s in self.sources[layer]]
        if part == Part.EARLY:  # reads the early units below, or any of the whole layer
            return all(_complete(b, Phase.FORWARD) or Part.EARLY in b for b in below)
        whole = all(_complete(b, Phase.FORWARD) for b in below)
        return whole and (part != Part.LATE or Part.EARLY in self.fwd[layer])

    def _grad_ready(self, layer: int, part: Part) -> bool:
        """Every layer that reads this one has given its gradient (and, from other workers,
        had it come in)."""
        return all(self._given(above, part) for above in self.readers[layer])

    def _given(self, above: int, part: Part) -> bool:
        started = {Part.ALL, Part.INPUT, Part.THROUGH} & self.bwd[above]
        if part == Part.LATE:  # its gradients come from this worker alone
            return bool(started) or Part.LATE in self.bwd[above]
        both = {Part.EARLY, Part.LATE} <= self.bwd[above]
        return bool(started or both) and self._halo_in(above, Phase.BACKWARD)
