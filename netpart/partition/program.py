"""A worker's program: the instructions the runtime interprets, and the check that it is sound.

`HaloSchedule.instructions(w)` writes worker w's program; `check_program` refuses, before any
process starts, a program that computes a layer before its input, uses a halo before waiting
for it, sends values it has not computed, mixes the parts of two different splits or ends with
a message in flight. Parts of a layer: forward, all | interior and boundary (the units that
read no halo, then the rest) | early and late (a producer chain's units its peers read, then
the rest) | joined; backward, all | input and weights | late and early | through.
"""

from __future__ import annotations

from dataclasses import dataclass

from netpart.errors import ScheduleError

__all__ = ["OPS", "PARTS", "Instruction", "check_program"]

OPS = ("compute", "send", "recv", "wait", "loss")
PARTS = {
    "forward": ("all", "interior", "boundary", "joined", "early", "late"),
    "backward": ("all", "input", "weights", "through", "late", "early"),
}
_WHOLE = {"forward": ({"all"}, {"joined"}), "backward": ({"all"}, {"through"})}


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
    loss: the loss over the output layer and its gradient.
    """

    op: str
    layer: int
    phase: str = "forward"
    peer: int = -1
    count: int = 0
    part: str = "all"

    def __str__(self) -> str:
        if self.op in ("send", "recv"):
            way = "to" if self.op == "send" else "from"
            return f"{self.op} {self.phase} halo of layer {self.layer} {way} {self.peer}"
        if self.op == "compute":
            return f"compute layer {self.layer} {self.phase} ({self.part})"
        return "loss" if self.op == "loss" else f"wait {self.phase} layer {self.layer}"


def check_program(program: tuple[Instruction, ...], layers: int, worker: int = 0) -> None:
    """Raise ScheduleError unless `program` (one worker's, for a model of `layers` layers)
    computes every layer forward and then backward exactly once, sends only what it has
    computed, uses a halo only after waiting for it, and ends with nothing in flight."""
    fwd: list[set[str]] = [set() for _ in range(layers)]
    bwd: list[set[str]] = [set() for _ in range(layers)]
    posted: set[tuple[int, str]] = set()
    waited: set[tuple[int, str]] = set()
    loss = False

    def fail(k: int, why: str) -> None:
        raise ScheduleError(f"worker {worker}, instruction {k} ({program[k]}): {why}")

    def complete(parts: set[str], phase: str) -> bool:
        halves = ({"early", "late"}, set(PARTS[phase][1:3]))
        return parts in _WHOLE[phase] or parts in halves

    def halo_in(layer: int, phase: str) -> bool:
        return (layer, phase) not in posted or (layer, phase) in waited

    def input_ready(layer: int, part: str) -> bool:
        below = fwd[layer - 1] if layer else {"all"}
        if part == "early":  # reads the early units below, or any of the whole layer
            return complete(below, "forward") or "early" in below
        return complete(below, "forward") and (part != "late" or "early" in fwd[layer])

    def grad_ready(layer: int, part: str) -> bool:
        above = layer + 1
        if above >= layers:
            return True
        started = {"all", "input", "through"} & bwd[above]
        if part == "late":  # its gradients come from this worker alone
            return bool(started) or "late" in bwd[above]
        return bool(started or {"early", "late"} <= bwd[above]) and halo_in(above, "backward")

    for k, ins in enumerate(program):
        key = (ins.layer, ins.phase)
        if ins.op not in OPS or ins.phase not in PARTS or not 0 <= ins.layer < layers:
            fail(k, "not an instruction of this model")
        if ins.op == "compute":
            done = (fwd if ins.phase == "forward" else bwd)[ins.layer]
            if ins.part not in PARTS[ins.phase] or ins.part in done or "all" in done:
                fail(k, "an unknown part, or a part computed twice")
            if ins.part in ("all", "joined", "through") and done:
                fail(k, "the whole layer after a part of it")
            if done and {ins.part, *done} not in ({"early", "late"}, set(PARTS[ins.phase][1:3])):
                fail(k, "parts of two different splits")
            if ins.part in ("joined", "through") and (not ins.layer or key in posted):
                fail(k, "a layer joined to the one below has no messages")
            if ins.part == "through" and "joined" not in fwd[ins.layer]:
                fail(k, "flows through a layer that was not joined")
            halves = ins.part in ("late", "early")
            if ins.phase == "backward" and halves != (fwd[ins.layer] == {"early", "late"}):
                fail(k, "backward parts unlike its forward parts (early and late)")
            if ins.phase == "forward":
                if loss or not input_ready(ins.layer, ins.part):
                    fail(k, "its input is not computed yet")
                if ins.part not in ("interior", "joined") and not halo_in(ins.layer, "forward"):
                    fail(k, "before its halo has arrived")
            elif not loss or not grad_ready(ins.layer, ins.part):
                fail(k, "the gradient of its outputs is not complete yet")
            done.add(ins.part)
        elif ins.op in ("send", "recv"):
            joined = {"joined", "through"} & (fwd[ins.layer] | bwd[ins.layer])
            if ins.layer == 0 or key in waited or ins.peer == worker or ins.count <= 0 or joined:
                fail(k, "a message outside the exchange of its layer")
            below = fwd[ins.layer - 1] if ins.layer else set()
            if ins.op == "send" and not (
                (complete(below, "forward") or "early" in below)
                if ins.phase == "forward"
                else {"all", "input"} & bwd[ins.layer]
            ):
                fail(k, "sends values it has not computed")
            posted.add(key)
        elif ins.op == "wait":
            if key not in posted or key in waited:
                fail(k, "waits for nothing posted, or twice")
            waited.add(key)
        else:
            if loss or not all(complete(f, "forward") for f in fwd):
                fail(k, "the loss before the whole forward pass, or twice")
            loss = True
    if not all(complete(b, "backward") for b in bwd) or posted != waited:
        raise ScheduleError(f"worker {worker}: the program ends before its backward pass does")
