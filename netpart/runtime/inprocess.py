"""TEST-ONLY: a partitioned step with every worker as a thread of this process.

The real runtime moves bytes between processes with torch.distributed; this runs the same
`ModelWorker` program over `ThreadTransport` (mailboxes of cloned tensors), so property tests
can check many random specs and plans quickly. Nothing in a training or timing path uses it.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from netpart.compile.schedule import SPLIT_MIN_FLOPS, plan_schedule
from netpart.errors import PeerError, ShapeMismatchError
from netpart.models.dropout import DropoutKey
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan
from netpart.runtime.result import StepResult, assemble
from netpart.runtime.state import WorkerResult
from netpart.runtime.transport import Handle
from netpart.runtime.worker import ModelWorker

__all__ = ["ThreadTransport", "run_step_threads"]


class _Hub:
    """Shared mailboxes and a reduction barrier for ThreadTransport."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.failed = threading.Event()

    def fail(self) -> None:
        """A worker died: wake everyone waiting instead of letting them time out."""
        self.failed.set()
        self.barrier.abort()

    def box(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())


class ThreadTransport:
    """In-process stand-in for tests: workers are threads, messages are cloned tensors."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    @classmethod
    def group(cls, size: int, timeout: float = 30.0) -> list[ThreadTransport]:
        hub = _Hub(size, timeout)
        return [cls(hub, r) for r in range(size)]

    def fail(self) -> None:
        self.hub.fail()

    def send(self, tag: int, peer: int, tensor: torch.Tensor) -> Handle:
        self.hub.box((tag, self.rank, peer)).put(tensor.clone())
        return Handle("send to", peer, tag, None, tensor)

    def recv(self, tag: int, peer: int, buffer: torch.Tensor) -> Handle:
        return Handle("receive from", peer, tag, self.hub.box((tag, peer, self.rank)), buffer)

    def wait(self, handles: list[Handle]) -> None:
        for h in handles:
            if h.work is not None:
                self._take(h)

    def _take(self, h: Handle) -> None:
        deadline = time.monotonic() + self.hub.timeout
        while True:
            try:
                got = h.work.get(timeout=0.05)
                break
            except queue.Empty:
                if self.hub.failed.is_set() or time.monotonic() > deadline:
                    raise PeerError(
                        f"worker {self.rank}: nothing from worker {h.peer} in phase {h.tag}"
                    ) from None
        if got.shape != h.tensor.shape:
            raise ShapeMismatchError(
                f"worker {self.rank}: phase {h.tag} from worker {h.peer}: got "
                f"{tuple(got.shape)}, buffer is {tuple(h.tensor.shape)}"
            )
        h.tensor.copy_(got)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        hub = self.hub
        hub.slots[self.rank] = tensor.clone()
        hub.barrier.wait()
        stacked = torch.stack(hub.slots)  # every rank sees the same values in rank order
        hub.barrier.wait()
        return stacked

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        stacked = self._gather(tensor)
        tensor.copy_(stacked.amax(dim=0) if op == "max" else stacked.sum(dim=0))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._gather(tensor)


def run_step_threads(
    spec: ModelSpec,
    plan: PartitionPlan,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    overlap: bool = True,
    split_min_flops: float = SPLIT_MIN_FLOPS,
    split: tuple[bool, ...] | None = None,
    dropout: DropoutKey | None = None,
) -> StepResult:
    """One partitioned step of `spec` by `plan`, workers as threads; the result as `run_step`'s
    (`split_min_flops=0, split=()` makes every program split whatever it can, for tests;
    `split` as `plan_schedule`'s; `dropout`: the step's key, as in training)."""
    graph, schedule = plan_schedule(
        spec, plan, overlap=overlap, split_min_flops=split_min_flops, split=split
    )
    transports = ThreadTransport.group(plan.workers)
    results: list[WorkerResult | None] = [None] * plan.workers
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            worker = ModelWorker(spec, graph, schedule, rank, seed=seed, dtype=dtype)
            results[rank] = worker.step(inputs, targets, transports[rank], dropout=dropout)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            transports[rank].fail()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(plan.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return assemble(spec, [r for r in results if r is not None], inputs.shape[0], dtype)
