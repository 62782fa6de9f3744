"""`run_step`: a partitioned step in N local processes, and the entry point of each of them.

`run_step` validates the plan and its schedule, writes a job directory (spec, plan files,
config, batch) and starts N processes of `python -m netpart.runtime.step --job DIR` through
the launcher. Each joins the gloo group, builds its `ModelWorker`, runs the step (or `steps`
timed steps) and writes `result_<rank>.pt` (loaded with weights_only). When one process
fails, the others get `timeout` seconds to notice through the process group, then are killed;
the error names the cause first (survivors' errors only name the peer they lost).

`run_link` uses the same job machinery for the link between processes: messages of each size
sent to and from every other process at once through the runtime's transport, as a halo
exchange sends them, and then the loss's collective (an all-gather of `GATHER_VALUES` floats
from each process) back to back, as a step's loss runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from netpart import faults
from netpart.compile.schedule import NO_SPLITS, SPLIT_MIN_FLOPS, plan_schedule
from netpart.errors import WorkerFailure
from netpart.files import write_files
from netpart.models.dropout import training_key
from netpart.models.reference import DTYPES
from netpart.models.spec import ModelSpec
from netpart.partition.plans import PartitionPlan, load_plan, plan_files
from netpart.processes.launcher import Processes, join_group
from netpart.processes.liveness import private_tmpdir
from netpart.runtime.breakdown import thread_usage
from netpart.runtime.result import StepResult, assemble, load_worker_result, save_worker_result
from netpart.runtime.state import WorkerResult
from netpart.runtime.transport import PEER_LOST, GlooTransport
from netpart.runtime.worker import ModelWorker
from netpart.timing import each_call, mean_call

__all__ = [
    "GATHER_VALUES",
    "LINK_SIZES",
    "StepOptions",
    "exchange_loop",
    "link_job",
    "link_loop",
    "link_result",
    "run_link",
    "run_step",
    "step_job",
    "step_loop",
    "timed_steps",
    "warmup_steps",
]

log = logging.getLogger(__name__)

LINK_SIZES = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes each way
GATHER_VALUES = 3 * 32 + 1  # the loss's all-gather at batch 32: (max, sum, target) + stop flag
GATHER_REPEATS = 100

TIMED_S = 0.5  # a timed run covers at least this long of steps (by the plan's prediction)
MOST_STEPS = 1000


def timed_steps(predicted_s: float, least: int = 10, seconds: float = TIMED_S) -> tuple[int, int]:
    """(timed steps, warm-up steps) of a run whose step is predicted to take `predicted_s`:
    at least `least` timed steps and about `seconds` of them (at most MOST_STEPS), and a
    tenth as many (at least 3) before them. A model of a millisecond a step settles only
    after tens of steps, and its median over ten steps moves by tens of percent."""
    wanted = int(np.ceil(seconds / max(predicted_s, 1e-6)))
    steps = int(min(max(least, wanted), max(least, MOST_STEPS)))
    return steps, warmup_steps(steps)


def warmup_steps(steps: int) -> int:
    """Untimed steps before `steps` timed ones: a tenth as many, at least 3."""
    return max(3, steps // 10)


@dataclass(frozen=True)
class StepOptions:
    """How `run_step` runs a plan's step (the job's `config.json`).

    `threads` is torch's intra-op thread count per worker; with `steps` > 1 each worker
    repeats the step (gradients zeroed, a barrier before each) and reports per-step wall times
    and breakdowns (`netpart.runtime.breakdown`), and the result describes the last step.
    `split` lets the programs hide halo exchange behind interior compute (off by default:
    processes that share one host exchange a halo as a memory copy on the same cores, and
    hiding it costs as much as it saves, docs/runtime.md); `overlap=False` runs programs that
    neither split nor join layers (for comparisons); `exchange_only` runs only the programs'
    messages (step times only, no gradients). A worker that waits `timeout` seconds for a peer
    gives up."""

    seed: int = 0
    dtype: str = "float64"  # a name of `netpart.models.reference.DTYPES`
    timeout: float = 60.0
    threads: int = 1
    steps: int = 1
    overlap: bool = True
    split: bool = False
    exchange_only: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: one of {', '.join(DTYPES)}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StepOptions:
        return cls(**json.loads(text))


def run_step(
    spec: ModelSpec,
    plan: PartitionPlan,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    options: StepOptions = StepOptions(),
) -> StepResult:
    """One forward/backward step of `spec` partitioned by `plan`, in `plan.workers` processes
    on this machine, as `options` say; the workers' results assembled in reference terms."""
    plan_schedule(spec, plan)  # refuse a foreign or corrupted plan before any process starts
    job = Path(private_tmpdir("job"))  # named by this launcher: swept if it is killed
    try:
        step_job(job, spec, plan, (inputs, targets), options)
        logs = [job / f"worker_{r}.log" for r in range(plan.workers)]
        with Processes("netpart.runtime.step", ["--job", str(job)], logs) as procs:
            _watch(procs, options.timeout)
        loaded = [load_worker_result(job / f"result_{r}.pt") for r in range(plan.workers)]
    finally:
        shutil.rmtree(job, ignore_errors=True)
    result = assemble(spec, [r for r, _, _ in loaded], inputs.shape[0], DTYPES[options.dtype])
    result.breakdowns = [p for _, p, _ in loaded]
    result.threads = [t for _, _, t in loaded]
    return result


def step_job(job: Path, spec: ModelSpec, plan: PartitionPlan, batch, options: StepOptions):
    """Write a step job into `job`: spec, plan files, options and the batch (inputs,
    targets); its processes (`python -m netpart.runtime.step --job JOB`, one per worker,
    started by any launcher) each write result_<rank>.pt."""
    files = plan_files(plan)
    files["spec.json"] = spec.to_json().encode()
    files["config.json"] = options.to_json().encode()
    write_files(job, files)
    torch.save({"inputs": batch[0], "targets": batch[1]}, job / "batch.pt")


def link_job(job: Path, sizes: tuple[int, ...], repeats: int, timeout: float = 60.0) -> None:
    """Write a link job into `job`: its processes (`python -m netpart.runtime.step --job JOB`,
    any number) then each write link_<rank>.json (see `run_link`)."""
    config = {"link_sizes": list(sizes), "repeats": repeats, "timeout": timeout, "threads": 1}
    write_files(job, {"config.json": json.dumps(config).encode()})


def link_result(job: Path, world: int) -> tuple[np.ndarray, float]:
    """(seconds per size, seconds of the loss's collective) of a finished link job: per size
    the slowest process's median; the collective's mean, on the slowest process."""
    done = [json.loads((job / f"link_{r}.json").read_text()) for r in range(world)]
    seconds = np.max(np.array([d["seconds"] for d in done]), axis=0)
    return seconds, max(float(d["gather_s"]) for d in done)


def run_link(
    sizes: tuple[int, ...] = LINK_SIZES, repeats: int = 10, timeout: float = 60.0, world: int = 2
) -> tuple[np.ndarray, float]:
    """Seconds for `world` local processes to exchange a message of each size (bytes) with
    every other, both ways at once, through the runtime's transport (the median of `repeats`,
    the slowest process), and of the loss's collective among them (`link_result`)."""
    with tempfile.TemporaryDirectory(prefix="netpart-link-") as tmp:
        job = Path(tmp)
        link_job(job, sizes, repeats, timeout)
        logs = [job / f"worker_{r}.log" for r in range(world)]
        with Processes("netpart.runtime.step", ["--job", str(job)], logs) as procs:
            _watch(procs, timeout)
        return link_result(job, world)


def _link(job: Path, config: dict) -> int:
    """One process of a link job (`link_loop`); writes link_<rank>.json."""
    rank, _ = join_group(float(config["timeout"]))
    try:
        seconds, gather = link_loop(GlooTransport(), config["link_sizes"], int(config["repeats"]))
        done = {"seconds": seconds, "gather_s": gather}
        (job / f"link_{rank}.json").write_text(json.dumps(done))
    finally:
        torch.distributed.destroy_process_group()
    return 0


def link_loop(transport, sizes, repeats: int) -> tuple[list[float], float]:
    """(seconds per size, seconds of the loss's collective) on this process: each size to and
    from every other process of `transport` at once (receives posted first, as the programs
    do), timed `repeats` times after one untimed round, a barrier before each, the median;
    then the loss's all-gather `GATHER_REPEATS` times back to back (no barrier: each waits
    for the last process to arrive, as in a step), the mean."""
    seconds = []
    peers = [r for r in range(transport.size) if r != transport.rank]
    for size in sizes:
        out = torch.zeros(max(int(size) // 4, 1))
        into = [torch.empty_like(out) for _ in peers]

        def exchange(out=out, into=into) -> None:
            posted = [transport.recv(0, p, b) for p, b in zip(peers, into, strict=True)]
            transport.wait(posted + [transport.send(0, p, out) for p in peers])

        runs = each_call(exchange, repeats, warm=1, before=transport.barrier)
        seconds.append(float(np.median([r.seconds for r in runs])))
    values = torch.zeros(GATHER_VALUES)
    transport.barrier()
    gather = mean_call(lambda: transport.all_gather(values), GATHER_REPEATS, warm=1)
    return seconds, gather.seconds


def _watch(procs: Processes, timeout: float) -> None:
    """Until every worker has ended: once one fails, the others get `timeout` to notice (none
    during start-up: the others wait in the rendezvous for it); a worker stopped for longer
    than `timeout` fails the job."""
    first_failure: float | None = None
    stopped: dict[int, float] = {}
    while procs.running():
        if procs.stopping.is_set():
            raise KeyboardInterrupt
        now, codes = time.monotonic(), procs.codes()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
        if first_failure is not None and (now - first_failure > timeout or not procs.started()):
            break
        for r in procs.stopped_ranks():
            if now - stopped.setdefault(r, now) > timeout:
                procs.kill(list(range(procs.world)))
                raise WorkerFailure(f"worker {r} was stopped (SIGSTOP) for over {timeout:g} s")
        stopped = {r: t for r, t in stopped.items() if r in procs.stopped_ranks()}
        time.sleep(0.05)
    dead = procs.codes()  # before the kill: who died of itself
    procs.kill(list(range(procs.world)))
    failed = [(r, c) for r, c in enumerate(procs.codes()) if c not in (0, None)]
    if failed:
        # Causes first: survivors' errors only name the peer they lost.
        failed.sort(key=lambda rc: (rc[1] != -9 and PEER_LOST in procs.last_error(rc[0]), rc[0]))
        raise WorkerFailure("; ".join(_failure(procs, r, c, dead[r]) for r, c in failed))


def _failure(procs: Processes, rank: int, code: int, before: int | None) -> str:
    """A failed worker in words: killed by us after the timeout, by a signal, or its error."""
    if before is None:
        return f"worker {rank} was killed after the timeout"
    if code < 0:
        return f"worker {rank} was killed by {signal.Signals(-code).name}"
    return f"worker {rank} exited with code {code}: {procs.last_error(rank)}"


def _worker(job: Path) -> int:
    """One worker process: join the group, build the worker, run the step(s), save."""
    text = (job / "config.json").read_text()
    if "link_sizes" in json.loads(text):
        return _link(job, json.loads(text))
    options = StepOptions.from_json(text)
    torch.set_num_threads(options.threads)
    spec = ModelSpec.from_json((job / "spec.json").read_text(), str(job / "spec.json"))
    plan = load_plan(job, spec)
    batch = torch.load(job / "batch.pt", weights_only=True)
    rank, _ = join_group(options.timeout)
    try:
        splits = SPLIT_MIN_FLOPS if options.split else NO_SPLITS
        graph, schedule = plan_schedule(  # validated by the launcher
            spec, plan, validate=False, overlap=options.overlap, split_min_flops=splits
        )
        dtype = DTYPES[options.dtype]
        worker = ModelWorker(spec, graph, schedule, rank, seed=options.seed, dtype=dtype)
        faults.point(rank, 0)
        transport = GlooTransport()
        if options.exchange_only:
            return _exchange_only(job, worker, transport, rank, len(batch["inputs"]), options.steps)
        result, breakdowns, usage = step_loop(worker, transport, batch, options.steps)
        save_worker_result(job / f"result_{rank}.pt", result, breakdowns, usage)
    finally:
        torch.distributed.destroy_process_group()
    return 0


def step_loop(worker: ModelWorker, transport, batch: dict, steps: int):
    """(the last step's WorkerResult holding every step's wall time, each step's breakdown,
    each step's thread CPU) of `steps` steps of `worker` on `batch` (inputs, targets); with
    more than one, a barrier starts each (timed steps start together)."""
    times, breakdowns, usage = [], [], []
    for i in range(steps):
        worker.zero_grad()
        before = thread_usage()
        if steps > 1:
            transport.barrier()
        start = time.perf_counter()
        inputs, targets = batch["inputs"], batch["targets"]
        key = training_key(worker.spec, worker.seed, i + 1)  # a training step's masks, if any
        result = worker.step(inputs, targets, transport, collect_grads=i == steps - 1, dropout=key)
        times.append(time.perf_counter() - start)
        after = thread_usage()
        breakdowns.append(result.breakdown)
        usage.append({k: v - before.get(k, 0.0) for k, v in after.items()})
    result.step_times = times
    return result, breakdowns, usage


def exchange_loop(worker: ModelWorker, transport, batch: int, steps: int) -> list[float]:
    """Seconds of each of `steps` steps of the worker's messages alone, a barrier before each."""
    times = []
    for _ in range(steps):
        transport.barrier()
        times.append(worker.exchange_only(batch, transport))
    return times


def _exchange_only(job: Path, worker: ModelWorker, transport, rank, batch, steps) -> int:
    """The messages of `steps` steps alone; writes a result holding only the step times."""
    times = exchange_loop(worker, transport, batch, steps)
    empty = torch.zeros(batch, 0)
    result = WorkerResult(rank, 0.0, empty, np.zeros(0, dtype=np.int64), [], step_times=times)
    save_worker_result(job / f"result_{rank}.pt", result, [], [])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m netpart.runtime.step")
    ap.add_argument("--job", type=Path, required=True)
    args = ap.parse_args()
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"worker {rank}: %(message)s", stream=sys.stderr)
    try:
        return _worker(args.job)
    except Exception as exc:  # one line for the launcher, which reports the last error line
        logging.getLogger("netpart.worker").error("error: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
