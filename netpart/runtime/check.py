"""`netpart check`: one partitioned step against the single-process reference, in float64.

This is how a user validates a custom spec: the same batch and the same initial weights go
through the reference module and through N worker processes; loss, outputs and every
parameter gradient must agree to `tolerance`, and the bytes each worker moved must equal what
the plan predicts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from netpart.compile.schedule import plan_schedule
from netpart.cost.memory import activation_values, worker_bytes
from netpart.errors import PlanError
from netpart.models.dropout import DropoutKey, training_key
from netpart.models.reference import build_reference, dropout_mask, reference_loss
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan
from netpart.processes.launcher import join_group
from netpart.processes.memory import available_memory
from netpart.runtime.result import StepResult, assemble
from netpart.runtime.step import StepOptions, run_step
from netpart.runtime.transport import GlooTransport
from netpart.runtime.worker import ModelWorker

__all__ = [
    "CheckReport",
    "check_step",
    "check_step_distributed",
    "compare_with_reference",
    "estimate_check_bytes",
    "lone_step",
    "make_batch",
    "require_memory",
    "under_torchrun",
]


@dataclass(frozen=True)
class Difference:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass(frozen=True)
class CheckReport:
    differences: tuple[Difference, ...]
    bytes_match: bool
    bytes_rows: tuple[tuple[int, str, int, int], ...]  # (layer, phase, measured, planned)

    @property
    def ok(self) -> bool:
        return self.bytes_match and all(d.ok for d in self.differences)


def make_batch(spec: ModelSpec, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic float64 batch: normal inputs, random classes (or normal MSE targets)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, spec.input.shape.size, generator=gen, dtype=torch.float64)
    if spec.loss == "cross_entropy":
        return x, torch.randint(0, spec.shapes[-1].channels, (batch,), generator=gen)
    return x, torch.randn(batch, spec.shapes[-1].size, generator=gen, dtype=torch.float64)


def lone_step(spec: ModelSpec, p: PartitionPlan, group, rank: int) -> Callable[[], None]:
    """A one-worker replica's step as training runs it (netpart's runtime, float32, no
    gradients gathered) on a fixed batch of 32 (`make_batch`, seed `rank`), its transport
    over `group`, this rank's own: what a measurement runs where a training step would be
    (`netpart.ps.timed_exchange.ps_loop`'s `beside`)."""
    graph, schedule = plan_schedule(spec, p)
    x, y = make_batch(spec, 32, rank)
    x = x.float()
    model = ModelWorker(spec, graph, schedule, 0, seed=0, dtype=torch.float32)
    transport = GlooTransport(group, ranks=[rank])
    key = training_key(spec, 0, 1)  # its layers' dropout on, as in training

    def step() -> None:
        model.step(x, y, transport, collect_grads=False, dropout=key)

    return step


def estimate_check_bytes(spec: ModelSpec, batch: int) -> int:
    """Memory a float64 check needs: the reference model and the workers, each holding the
    whole model's values as a worker does (`netpart.cost.memory.worker_bytes`)."""
    acts = activation_values(spec)
    return int(
        2 * worker_bytes(params=spec.num_params, activations=acts, batch=batch, value_bytes=8)
    )


def require_memory(spec: ModelSpec, batch: int, doing: str = "checking") -> None:
    """Raise PlanError when a float64 check of `spec` (or `doing` what needs as much)
    cannot fit in the available memory."""
    need, have = estimate_check_bytes(spec, batch), available_memory()
    if need > have:
        raise PlanError(
            f"{doing} {spec.name} needs about {need / 2**30:.1f} GiB but {have / 2**30:.1f} "
            "GiB are available; choose a smaller model or batch"
        )


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> Difference:
    err = (got - want).abs()
    max_abs = float(err.max()) if err.numel() else 0.0
    denom = want.abs().clamp_min(1e-300)
    max_rel = float((err / denom).max()) if err.numel() else 0.0
    ok = bool(torch.all(err <= tol + tol * want.abs())) if err.numel() else True
    return Difference(name, max_abs, max_rel, ok)


def compare_with_reference(
    spec: ModelSpec,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
    result: StepResult,
    tolerance: float,
    module: torch.nn.Module | None = None,
    dropout: DropoutKey | None = None,
) -> tuple[Difference, ...]:
    """Run the reference step on the same batch and compare loss, outputs and every grad.

    With `module` (the user's own, its spec imported from it) that module is the reference:
    it gets the same initial weights under its own parameter names, takes the batch in its
    input shape, and its gradients are compared name by name. `dropout`: the step's key;
    the user's dropout modules then apply netpart's masks (`netpart.models.dropout`)."""
    reference = build_reference(spec, seed, torch.float64)
    model: torch.nn.Module = reference
    names: dict[str, str] = {}  # the reference's parameter names -> the module's
    if module is None:
        out = reference(x, dropout)
    else:
        names = {**spec.state_names(), **spec.buffer_names()}
        model = module.double()
        model.load_state_dict({names[k]: v for k, v in reference.state_dict().items()})
        with _masked_dropout(spec, model, x.shape[0], dropout):
            out = model(x.reshape(x.shape[0], *spec.input.dims))
    loss = reference_loss(spec, out, y)
    if loss.requires_grad:
        loss.backward()
    got_loss = torch.tensor([result.loss], dtype=torch.float64)
    diffs = [
        _diff("loss", got_loss, loss.detach().reshape(1), tolerance),
        _diff("outputs", result.outputs.reshape(out.shape), out.detach(), tolerance),
    ]
    grads = {names.get(k, k): g for k, g in result.grads.items()}
    for name, p in model.named_parameters():
        diffs.append(_diff(f"grad {name}", grads[name], p.grad, tolerance))
    buffers = dict(model.named_buffers())
    for ours, got in result.statistics.items():  # the batch norms' running statistics
        name = names.get(ours, ours)
        diffs.append(_diff(name, got, buffers[name].detach(), tolerance))
    return tuple(diffs)


@contextlib.contextmanager
def _masked_dropout(spec: ModelSpec, module: torch.nn.Module, batch: int, key: DropoutKey | None):
    """Within the block, the k-th dropout module `module` runs applies the mask of the k-th
    spec layer with dropout (the chain's order), not torch's random one; with no `key`,
    none (the reference's step without dropout)."""
    calls = iter(spec.dropout_layers)

    def masked(mod, inputs, output):
        index = next(calls)
        if key is None:
            return inputs[0]
        return inputs[0] * dropout_mask(spec, index, batch, key, inputs[0].dtype)

    drops = [m for m in module.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    hooks = [m.register_forward_hook(masked) for m in drops]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _byte_rows(sent: np.ndarray, planned: np.ndarray) -> tuple[tuple[int, str, int, int], ...]:
    """(layer, phase, measured, planned) from sent[L, 2] and planned traffic [L, P, P] bytes."""
    return tuple(
        (layer, phase, int(sent[layer, j]), int(planned[layer].sum()))
        for layer in range(1, len(sent))
        for j, phase in enumerate(("forward", "backward"))
    )


def check_step(
    spec: ModelSpec,
    plan: PartitionPlan,
    batch: int = 4,
    seed: int = 0,
    tolerance: float = 1e-9,
    timeout: float = 60.0,
    module: torch.nn.Module | None = None,
) -> tuple[CheckReport, StepResult]:
    """Run the reference (`module`, the user's own, when given) and the partitioned step on
    the same batch and compare everything."""
    require_memory(spec, batch)
    x, y = make_batch(spec, batch, seed)
    result = run_step(spec, plan, x, y, StepOptions(seed=seed, dtype="float64", timeout=timeout))
    key = training_key(spec, seed, 1)  # the masks of run_step's one step
    diffs = compare_with_reference(spec, x, y, seed, result, tolerance, module, key)
    _, schedule = plan_schedule(spec, plan, validate=False)  # run_step validated it
    planned = schedule.traffic() * batch * 8
    sent = np.zeros((len(spec.layers), 2), dtype=np.int64)
    match = True
    for w, per_worker in enumerate(result.sent):
        for (layer, phase), v in per_worker.items():
            sent[layer, 0 if phase == "forward" else 1] += v
        for layer in range(1, len(spec.layers)):  # per worker too, forward in and out
            want = int(planned[layer, w].sum()), int(planned[layer, :, w].sum())
            got = (
                per_worker.get((layer, "forward"), 0),
                result.received[w].get((layer, "forward"), 0),
            )
            match &= want == got
    rows = _byte_rows(sent, planned)
    match &= all(m == p for _, _, m, p in rows)
    return CheckReport(diffs, bool(match), rows), result


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another env:// launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def check_step_distributed(
    spec: ModelSpec,
    plan: PartitionPlan,
    batch: int = 4,
    seed: int = 0,
    tolerance: float = 1e-9,
    timeout: float = 60.0,
    module: torch.nn.Module | None = None,
) -> CheckReport | None:
    """`check_step` for a rank started by torchrun: one step over the env:// process group.

    Every rank adds its gradient slices into zero tensors of the reference shapes and an
    all-reduce sums them (tied conv kernels included); rank 0 compares and gets the report,
    the other ranks get None.
    """
    join_group(timeout)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != plan.workers:
            raise PlanError(
                f"torchrun started {world} ranks but the plan has {plan.workers} workers"
            )
        graph, schedule = plan_schedule(spec, plan)
        x, y = make_batch(spec, batch, seed)
        worker = ModelWorker(spec, graph, schedule, rank, seed=seed, dtype=torch.float64)
        key = training_key(spec, seed, 1)
        mine = worker.step(x, y, GlooTransport(), dropout=key)
        result = assemble(spec, [mine], batch, torch.float64, check_loss=False)
        for t in (*result.grads.values(), result.outputs):
            dist.all_reduce(t)
        for name in sorted(result.statistics):  # each channel's, from the ranks holding it
            held = torch.zeros_like(result.statistics[name])
            for ours, channels, _ in mine.statistics:
                if ours == name:
                    held[torch.from_numpy(channels)] = 1.0
            dist.all_reduce(result.statistics[name])
            dist.all_reduce(held)
            result.statistics[name] /= held.clamp(min=1.0)
        sent = torch.zeros(len(spec.layers), 2, dtype=torch.int64)
        for (layer, phase), v in mine.sent.items():
            sent[layer, 0 if phase == "forward" else 1] += v
        dist.all_reduce(sent)
        if rank != 0:
            return None
        diffs = compare_with_reference(spec, x, y, seed, result, tolerance, module, key)
        rows = _byte_rows(sent.numpy(), schedule.traffic() * batch * 8)
        return CheckReport(diffs, all(m == p for _, _, m, p in rows), rows)
    finally:
        dist.destroy_process_group()
