"""The memory a model's training holds: what a model worker and a parameter-server shard keep,
per the values they hold and the examples of their batch. The one estimate: `netpart train`
refuses a job with it (`netpart.planning.memory`), `plan --machines` weighs layouts with it,
and `netpart check` sizes its float64 step with it.

Every process pays the interpreter with torch loaded (`BASE_BYTES`); a worker holds its
parameters about four times (values, gradients, the fetched copy, the optimizer's buffers)
and, per example of its batch, what `activation_values` counts; a shard holds its values and
its optimizer's state. The weights of `activation_values` are fitted to measured peaks
(`benchmarks/memory_bench.py`; how close, in docs/measurements.md).
"""

from __future__ import annotations

from netpart.models.spec import ModelSpec

__all__ = ["BASE_BYTES", "activation_values", "shard_bytes", "worker_bytes"]

BASE_BYTES = 80 * 2**20  # one process with torch imported, resident (rounded down)


def activation_values(spec: ModelSpec) -> int:
    """Values per example a replica's workers hold at the peak of a step: each layer's
    outputs (forward values, activations, their gradients and copies), its inputs (buffers
    and their gradients), and the windows a locally connected or conv layer unfolds (the
    patches and their gradient) or an LCN reads, and a dropout layer's mask and dropped
    outputs."""
    total = 0
    for i, layer in enumerate(spec.layers):
        src, out = spec.input_shape(i), spec.shapes[i]
        total += (8 if layer.dropout else 6) * out.size + 2 * src.size
        if layer.kind in ("local", "conv", "lcn"):
            windows = src.channels * layer.window * out.height * out.width
            total += (3 if layer.kind != "lcn" else 1) * windows
    return total


def worker_bytes(*, params: float, activations: float, batch: int, value_bytes: int) -> float:
    """A model worker's bytes beyond its interpreter: its `params` about four times (values,
    gradients, the fetched copy, the optimizer's buffers) and `activations` values per
    example of its batch."""
    return 4 * params * value_bytes + batch * activations * value_bytes


def shard_bytes(*, values: float, optimizer: str, value_bytes: int, history: int = 10) -> float:
    """A parameter-server shard's bytes beyond its interpreter: its values and the optimizer's
    state (Adagrad's accumulator and its gradient buffer; L-BFGS's `history` pairs)."""
    slots = {"adagrad": 2, "lbfgs": 2 * history + 3}.get(optimizer, 1)
    return (1 + slots) * values * value_bytes
