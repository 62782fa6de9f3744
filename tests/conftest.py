"""Shared test helpers: random small specs (hypothesis), a brute-force unit-level recount, and
a spec's reference holding a user's module's weights."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from netpart.errors import SpecError
from netpart.models import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.processes.zygote import Preloaded

BIAS = st.sampled_from([{}, {}, {"bias": False}])  # a weighted layer without a bias, at times
DROPOUT = st.sampled_from([{}, {}, {}, {"dropout": 0.5}, {"dropout": 0.2}])
# A weighted layer's activation, leaky_relu with its slope.
ACTIVATIONS = st.one_of(
    st.sampled_from(["relu", "tanh", "sigmoid", "gelu", "silu", "none"]).map(
        lambda a: {"activation": a}
    ),
    st.floats(-0.5, 0.5).map(lambda s: {"activation": "leaky_relu", "negative_slope": s}),
)


@st.composite
def windows(draw: st.DrawFn, pad_most: int) -> tuple:
    """A kernel, stride and padding: square at times, else [height, width] each (a stride at
    most the kernel, a padding below it and at most `pad_most`, per axis)."""
    if draw(st.booleans()):
        k = draw(st.integers(1, 3))
        return k, draw(st.integers(1, min(k, 2))), draw(st.integers(0, min(k - 1, pad_most)))
    ks = [draw(st.integers(1, 3)) for _ in range(2)]
    strides = [draw(st.integers(1, min(k, 2))) for k in ks]
    pads = [draw(st.integers(0, min(k - 1, pad_most))) for k in ks]
    return ks, strides, pads


@st.composite
def small_specs(draw: st.DrawFn, max_layers: int = 4) -> ModelSpec:
    """Random valid specs mixing local, conv, pool, lcn and dense layers, a few units each."""
    flat = draw(st.booleans().map(lambda b: b and draw(st.integers(0, 3)) == 0))
    if flat:
        inp = {"features": draw(st.integers(2, 12))}
    else:
        side = draw(st.integers(5, 11))
        inp = {
            "channels": draw(st.integers(1, 3)),
            "height": side,
            "width": draw(st.integers(5, 11)),
        }
    layers = []
    spatial = not flat
    named = draw(st.booleans())  # an imported spec's layers carry their module paths
    for _ in range(draw(st.integers(1, max_layers))):
        kinds = ["local", "conv", "pool", "lcn", "dense"] if spatial else ["dense"]
        kind = draw(st.sampled_from(kinds))
        if kind in ("local", "conv"):
            kernel, stride, padding = draw(windows(pad_most=1))
            layers.append(
                {
                    "kind": kind,
                    "channels": draw(st.integers(1, 3)),
                    "kernel": kernel,
                    "stride": stride,
                    "padding": padding,
                    **draw(ACTIVATIONS),
                    **draw(BIAS),
                }
            )
        elif kind == "pool":
            kernel, stride, padding = draw(windows(pad_most=2))
            layers.append(
                {
                    "kind": "pool",
                    "mode": draw(st.sampled_from(["max", "avg", "l2"])),
                    "kernel": kernel,
                    "stride": stride,
                    "padding": padding,
                }
            )
        elif kind == "lcn":
            layers.append({"kind": "lcn", "kernel": draw(st.sampled_from([1, 3]))})
        else:
            dense = {"kind": "dense", "units": draw(st.integers(1, 6))}
            layers.append({**dense, **draw(ACTIVATIONS), **draw(BIAS)})
            spatial = False
    if named:
        layers = [{**layer, "name": f"net.{i}"} for i, layer in enumerate(layers)]
    for layer in layers[:-1]:  # dropout, at times, on any layer but the last
        layer.update(draw(DROPOUT))
    try:
        return ModelSpec.from_dict({"name": "random", "input": inp, "layer": layers})
    except SpecError:
        assume(False)
        raise


@st.composite
def chain_specs(draw: st.DrawFn) -> ModelSpec:
    """Specs shaped like bench-local (a layer, a pool, a layer with a window, a dense top), on
    whose plans producer chains of several layers are common."""
    act = st.sampled_from(["relu", "tanh", "sigmoid", "none"])
    layers = [
        {
            "kind": draw(st.sampled_from(["local", "conv"])),
            "channels": draw(st.integers(1, 3)),
            "kernel": draw(st.integers(1, 3)),
            "stride": 1,
            "activation": draw(act),
        },
        {
            "kind": "pool",
            "mode": draw(st.sampled_from(["max", "avg", "l2"])),
            "kernel": 2,
            "stride": 2,
        },
    ]
    top = draw(st.sampled_from(["lcn", "local", "conv", "pool"]))
    if top == "lcn":
        layers.append({"kind": "lcn", "kernel": 3})
    elif top == "pool":
        layers.append({"kind": "pool", "mode": "max", "kernel": 2, "stride": 1, "padding": 1})
    else:
        window = {"channels": 2, "kernel": 3, "stride": 1, "padding": 1, "activation": draw(act)}
        layers.append({"kind": top, **window})
    for layer in layers:  # dropout, at times, below the top
        layer.update(draw(DROPOUT))
    layers.append({"kind": "dense", "units": draw(st.integers(2, 4)), "activation": "softmax"})
    inp = {
        "channels": draw(st.integers(1, 2)),
        "height": draw(st.integers(8, 12)),
        "width": draw(st.integers(8, 12)),
    }
    return ModelSpec.from_dict({"name": "chain", "input": inp, "layer": layers})


def reads(
    spec: ModelSpec, index: int, unit: tuple[int, int, int], slot: int = 0
) -> list[tuple[int, int, int]]:
    """Units (c, y, x) of input `slot` that output unit `unit` of layer `index` reads:
    explicit loops."""
    layer = spec.layers[index]
    source = spec.sources(index)[slot]
    src = spec.input.shape if source < 0 else spec.shapes[source]
    c, y, x = unit
    if layer.kind in ("add", "batchnorm"):
        return [(c, y, x)]
    if layer.kind == "concat":
        before = sum(
            (spec.input.shape if s < 0 else spec.shapes[s]).channels
            for s in spec.sources(index)[:slot]
        )
        return [(c - before, y, x)] if before <= c < before + src.channels else []
    if layer.kind == "dense":
        return list(itertools.product(range(src.channels), range(src.height), range(src.width)))
    if layer.kind == "lcn":
        (kh, kw), (sh, sw), (ph, pw) = (layer.kernel,) * 2, (1, 1), (layer.kernel // 2,) * 2
    else:
        (kh, kw), (sh, sw), (ph, pw) = layer.kernel_hw, layer.stride_hw, layer.padding_hw
    chans = [c] if layer.kind == "pool" else range(src.channels)
    out = []
    for ch in chans:
        for dy in range(kh):
            for dx in range(kw):
                yy, xx = y * sh - ph + dy, x * sw - pw + dx
                if 0 <= yy < src.height and 0 <= xx < src.width:
                    out.append((ch, yy, xx))
    return out


def unit_owner(graph: UnitGraph, node_map: np.ndarray, index: int) -> dict:
    """Owner of every unit (c, y, x) of layer `index`, found by scanning block boxes."""
    lb = graph.layers[index]
    owner = {}
    for b in range(lb.first, lb.first + lb.count):
        c0, c1, y0, y1, x0, x1 = graph.box[b]
        for u in itertools.product(range(c0, c1), range(y0, y1), range(x0, x1)):
            assert u not in owner, f"unit {u} of layer {index} is in two blocks"
            owner[u] = int(node_map[b])
    return owner


def brute_force_volume(graph: UnitGraph, node_map: np.ndarray) -> list[int]:
    """Per-layer forward volume: distinct (source unit, remote reader worker) pairs, for
    each layer a layer reads (the network's input is data: none), a layer read twice once."""
    spec = graph.spec
    out = [0]
    for i in range(1, len(spec.layers)):
        dst_owner = unit_owner(graph, node_map, i)
        pairs = set()
        for slot, source in enumerate(spec.sources(i)):
            if source < 0:
                continue
            src_owner = unit_owner(graph, node_map, source)
            for unit, d in dst_owner.items():
                for src in reads(spec, i, unit, slot):
                    if src_owner[src] != d:
                        pairs.add((source, src, d))
        out.append(len(pairs))
    return out


@st.composite
def graph_specs(draw: st.DrawFn, max_steps: int = 6) -> ModelSpec:
    """Random layer graphs: windowed layers (conv, local, pool, lcn) and batch norms reading
    any layer of the current resolution, adds of equal shapes, concats, a ResNet's
    downsampling block (a 3x3, stride-2 conv and a 1x1, stride-2 projection of one layer,
    added), every unread layer concatenated at the end, a dense top at times (or two dense
    layers of the planes added or concatenated, maybe batch-normed, under it)."""
    h, w = draw(st.integers(4, 9)), draw(st.integers(4, 9))
    layers: list[dict] = []
    shapes: list[tuple[int, int, int]] = []
    unread: list[int] = []
    stage = 0  # the first layer of the current resolution

    def put(layer: dict, shape: tuple[int, int, int], inputs: list[int]) -> int:
        for i in inputs:
            if i in unread:
                unread.remove(i)
        layers.append({**layer, "inputs": inputs} if inputs else layer)
        shapes.append(shape)
        unread.append(len(layers) - 1)
        return len(layers) - 1

    def close() -> None:
        if len(unread) > 1:
            c = sum(shapes[i][0] for i in unread)
            put({"kind": "concat"}, (c, *shapes[unread[0]][1:]), list(unread))

    c = draw(st.integers(1, 3))
    put({"kind": "conv", "channels": c, "kernel": 3, "padding": 1}, (c, h, w), [])
    for _ in range(draw(st.integers(1, max_steps))):
        now = list(range(stage, len(layers)))
        op = draw(st.sampled_from(["conv", "local", "pool", "lcn", "batchnorm", "add", "concat"]))
        if draw(st.integers(0, 5)) == 0 and min(shapes[-1][1:]) >= 4:
            op = "down"
        src = draw(st.sampled_from(sorted(set(unread) & set(now)) or now))
        cs, hs, ws = shapes[src]
        if op in ("conv", "local"):
            k = draw(st.sampled_from([1, 3]))
            ch = draw(st.integers(1, 3))
            layer = {"kind": op, "channels": ch, "kernel": k, "padding": k // 2}
            put({**layer, **draw(BIAS)}, (ch, hs, ws), [src])
        elif op == "pool":
            mode = draw(st.sampled_from(["max", "avg", "l2"]))
            put(
                {"kind": "pool", "mode": mode, "kernel": 3, "stride": 1, "padding": 1},
                (cs, hs, ws),
                [src],
            )
        elif op == "lcn":
            put({"kind": "lcn", "kernel": 3}, (cs, hs, ws), [src])
        elif op == "batchnorm":
            put({"kind": "batchnorm"}, (cs, hs, ws), [src])
        elif op == "add":
            same = [i for i in now if shapes[i] == shapes[src] and i != src]
            other = draw(st.sampled_from(same)) if same else src  # x + x at times
            put({"kind": "add"}, shapes[src], [src, other])
        elif op == "concat":
            other = draw(st.sampled_from(now))
            put({"kind": "concat"}, (cs + shapes[other][0], hs, ws), [src, other])
        else:  # a downsampling residual block on the one unread layer of this resolution
            close()
            x = unread[0]
            ch = draw(st.integers(1, 3))
            hh, ww = (shapes[x][1] + 1) // 2, (shapes[x][2] + 1) // 2
            a = put(
                {"kind": "conv", "channels": ch, "kernel": 3, "stride": 2, "padding": 1},
                (ch, hh, ww),
                [x],
            )
            b = put({"kind": "conv", "channels": ch, "kernel": 1, "stride": 2}, (ch, hh, ww), [x])
            put({"kind": "add"}, (ch, hh, ww), [a, b])
            stage = a
    close()
    top = draw(st.sampled_from(["none", "dense", "branches"]))
    if top == "branches":  # two dense layers of the planes, merged, batch-normed at times
        k, last = draw(st.integers(1, 4)), len(layers) - 1
        a = put({"kind": "dense", "units": k}, (k, 1, 1), [last])
        b = put({"kind": "dense", "units": k, **draw(ACTIVATIONS)}, (k, 1, 1), [last])
        merge = draw(st.sampled_from(["add", "concat"]))
        put({"kind": merge}, (k if merge == "add" else 2 * k, 1, 1), [a, b])
        if draw(st.booleans()):
            put({"kind": "batchnorm"}, shapes[-1], [len(layers) - 1])
    if top != "none":
        put({"kind": "dense", "units": draw(st.integers(1, 4))}, (1, 1, 1), [len(layers) - 1])
    inp = {"channels": draw(st.integers(1, 2)), "height": h, "width": w}
    return ModelSpec.from_dict({"name": "graph", "input": inp, "layer": layers})


# Every process this test session starts inherits this variable (through the zygote and a
# new session, and after its parent died): the leak checks count only those, never another
# netpart job on the same machine.
SESSION = f"NETPART_TEST_SESSION={os.getpid()}-{time.time_ns()}"
os.environ["NETPART_TEST_SESSION"] = SESSION.split("=", 1)[1]


def count_processes(marker: bytes) -> int:
    """This test session's processes whose command line contains `marker` (read from
    /proc: the command line, and the environment they inherited from this session), but
    for this process's kept zygotes (each waits for its next job and ends with this one)."""
    besides = Preloaded.kept_pids()
    count = 0
    mine = SESSION.encode() + b"\0"
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) in besides:
            continue
        try:
            if marker in (proc / "cmdline").read_bytes() and mine in (
                (proc / "environ").read_bytes() + b"\0"
            ):
                count += 1
        except OSError:
            continue
    return count


def finish(procs: list, timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it has ended; whatever still runs when the block
    ends (a timeout, a failed assertion) is killed and reaped."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def torch_lbfgs(spec, x, y, lr: float, iterations: int, history: int):
    """The reference model (seed 0, float64) after torch.optim.LBFGS with a fixed step on the
    whole batch (x, y); returns (model, optimizer) for comparison."""
    import torch

    from netpart.models import build_reference

    ref = build_reference(spec, 0, torch.float64)
    opt = torch.optim.LBFGS(ref.parameters(), lr=lr, max_iter=iterations, history_size=history)

    def closure():
        opt.zero_grad()
        loss = ref.loss(ref(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    return ref, opt


def wait_for_lines(path: Path, count: int, timeout: float = 60.0, poll: float = 0.02) -> None:
    """Return once the file at `path` holds `count` lines (or after `timeout` seconds: the
    test then fails on what it checks next, not here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (
        not path.exists() or path.read_text().count("\n") < count
    ):
        time.sleep(poll)


def users_reference(spec: ModelSpec, user):
    """`spec`'s reference module in float64 holding the parameters and buffers of `user` (the
    module it was imported from), read under the user's names (`ModelSpec.state_names`,
    `buffer_names`)."""
    import torch

    from netpart.models import build_reference

    reference = build_reference(spec, dtype=torch.float64)
    theirs = user.state_dict()
    names = {**spec.state_names(), **spec.buffer_names()}
    reference.load_state_dict({ours: theirs[name] for ours, name in names.items()})
    return reference


def assert_grads_equal(spec: ModelSpec, reference, user, atol: float) -> None:
    """Every gradient of `reference` equal to the user's of the same parameter."""
    import torch

    theirs, names = dict(user.named_parameters()), spec.state_names()
    for name, value in reference.named_parameters():
        assert torch.allclose(value.grad, theirs[names[name]].grad, rtol=1e-10, atol=atol), name
