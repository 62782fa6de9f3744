"""Entry point of one model-worker process: `python -m netpart.runtime.worker_main --job DIR`.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (set by `run_step`,
the same names torchrun uses). The process reads the job directory, joins the gloo process
group through the launcher's store, runs one step and writes `result_<rank>.pt`. Any error
ends the process with code 1 and one line on stderr naming what failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.files import load_plan
from netpart.models.spec import ModelSpec
from netpart.runtime.result import save_worker_result
from netpart.runtime.schedule import plan_schedule
from netpart.runtime.transport import GlooTransport
from netpart.runtime.worker import ModelWorker

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _fault_injection(rank: int) -> None:
    """Test hook: NETPART_TEST_FAULT=die:R or hang:R makes worker R die or hang mid-run."""
    fault = os.environ.get("NETPART_TEST_FAULT", "")
    kind, _, who = fault.partition(":")
    if who and int(who) == rank:
        if kind == "die":
            os._exit(17)
        if kind == "hang":
            time.sleep(3600)


def _worker_main(job: Path) -> int:
    """Entry of one worker process: RANK/WORLD_SIZE/MASTER_* come from the environment."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = json.loads((job / "config.json").read_text())
    torch.set_num_threads(int(config["threads"]))
    spec = ModelSpec.from_json((job / "spec.json").read_text(), str(job / "spec.json"))
    plan = load_plan(job, spec)
    batch = torch.load(job / "batch.pt", weights_only=True)
    timeout = datetime.timedelta(seconds=float(config["timeout"]))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1, False, timeout=timeout
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        graph, schedule = plan_schedule(spec, plan, validate=False)  # the launcher validated
        worker = ModelWorker(spec, graph, schedule, rank, config["seed"], DTYPES[config["dtype"]])
        _fault_injection(rank)
        transport = GlooTransport()
        times = []
        steps = int(config.get("steps", 1))  # > 1 only for benchmarks
        for i in range(steps):
            worker.zero_grad()
            if steps > 1:  # timed steps start together
                transport.barrier()
            start = time.perf_counter()
            result = worker.step(batch["inputs"], batch["targets"], transport, i == steps - 1)
            times.append(time.perf_counter() - start)
        result.step_times = times
        save_worker_result(job / f"result_{rank}.pt", result)
    finally:
        dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m netpart.runtime.worker_main")
    ap.add_argument("--job", type=Path, required=True)
    args = ap.parse_args()
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(
        level=logging.INFO, format=f"worker {rank}: %(message)s", stream=sys.stderr, force=True
    )
    try:
        return _worker_main(args.job)
    except Exception as exc:  # one line for the launcher, which reports the last error line
        logging.getLogger("netpart.worker").error("error: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
