"""Run a partitioned step with every worker as a thread of this process (unit tests only).

The real runtime moves bytes between processes with torch.distributed (`launch.py`); this
runs the same `ModelWorker` code over `ThreadTransport` so property tests can check many
random specs and plans quickly.
"""

from __future__ import annotations

import threading

import torch

from netpart.models.spec import ModelSpec
from netpart.partition.planner import PartitionPlan
from netpart.runtime.result import StepResult, assemble
from netpart.runtime.schedule import plan_schedule
from netpart.runtime.transport import ThreadTransport
from netpart.runtime.worker import ModelWorker, WorkerResult

__all__ = ["run_step_threads"]


def run_step_threads(
    spec: ModelSpec,
    plan: PartitionPlan,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> StepResult:
    graph, schedule = plan_schedule(spec, plan)
    transports = ThreadTransport.group(plan.workers)
    results: list[WorkerResult | None] = [None] * plan.workers
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            worker = ModelWorker(spec, graph, schedule, rank, seed, dtype)
            results[rank] = worker.step(inputs, targets, transports[rank])
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            transports[rank].hub.fail()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(plan.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return assemble(spec, [r for r in results if r is not None], inputs.shape[0], dtype)
