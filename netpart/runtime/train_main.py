"""Entry point of one training process: `python -m netpart.runtime.train_main --run DIR`.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (set by the local
launcher, the names torchrun uses). The process reads the run directory (spec, plan, config,
start steps), joins the default gloo group and plays its role (see `netpart.runtime.trainer`).
SIGTERM or SIGINT ends training at the next step boundary: workers push what they hold and say
goodbye, shards write a final checkpoint. Any error ends the process with code 1 and one line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from netpart.files import load_plan
from netpart.models.spec import ModelSpec
from netpart.runtime.config import TrainConfig
from netpart.runtime.trainer import PS_TIMEOUT, job_placement, run_process


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (the process then finishes its step and exits)."""
    stop = threading.Event()

    def handler(signum, frame):
        logging.getLogger("netpart.train").info("signal %d: stopping after this step", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def log_as(who: str) -> None:
    """Prefix this process's log lines with its role and rank: '[replica 1 worker 0 (rank 2)]'."""
    logging.basicConfig(
        level=logging.INFO, format=f"[{who}] %(message)s", stream=sys.stderr, force=True
    )


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m netpart.runtime.train_main")
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log_as(f"rank {rank}")
    stop = stop_on_signals()
    run: Path = args.run
    try:
        manifest = json.loads((run / "train.json").read_text())
        config = TrainConfig.from_dict(manifest["config"])
        torch.set_num_threads(config.threads)
        spec = ModelSpec.from_json((run / "spec.json").read_text(), str(run / "spec.json"))
        plan = load_plan(run, spec)
        starts = {int(r): int(s) for r, s in json.loads((run / "start.json").read_text()).items()}
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world + 1,
            False,
            timeout=datetime.timedelta(seconds=max(60.0, config.timeout)),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=PS_TIMEOUT
        )
        placement = job_placement(config, plan.workers)
        log_as(f"{placement.name(rank)} (rank {rank})")
        run_process(rank, spec, plan, config, run, starts, args.resume, stop, placement)
    except Exception as exc:  # one line for the launcher, which reports the last error line
        logging.getLogger("netpart.train").error("error: %s", exc)
        sys.stderr.flush()
        os._exit(1)  # peers in other threads may still block in gloo: do not wait for them
    sys.stderr.flush()
    os._exit(0)  # same: a lost replica's connections must not hold up a finished process


if __name__ == "__main__":
    raise SystemExit(main())
