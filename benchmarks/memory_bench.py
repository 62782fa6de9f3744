"""Memory of a training job against the estimate `netpart train` checks before it starts.

For each (model, batch) case, `netpart train` runs a few steps on this machine while the
benchmark samples the memory of the job's processes (the children of its preloaded
interpreter: their proportional set sizes, `netpart.processes.liveness.job_pss`) every
20 ms; the peak of their sum is set against
`netpart.planning.memory.estimate` for the same job. The estimate must not be low by more than
1.5x (a job it passes must fit), and is reported with its parts.

    python benchmarks/memory_bench.py --out benchmarks/results/memory_bench.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from harness import parser, write_results

CASES = [
    ("digits-mlp", 32),
    ("digits-mlp", 2000),
    ("tiny-local", 32),
    ("tiny-local", 512),
    ("tiny-local", 4000),
    ("bench-local", 32),
    ("bench-local", 256),
    ("bench-local", 1024),
]
WORKERS, REPLICAS, STEPS = 2, 2, 6


def measure(model: str, batch: int) -> dict:
    from netpart.processes.liveness import job_pss

    marker = f"NETPART_MEMORY_BENCH={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            sys.executable,
            *"-m netpart train --model".split(),
            model,
            "--workers",
            str(WORKERS),
            "--replicas",
            str(REPLICAS),
            "--ps-shards",
            str(WORKERS),
            "--steps",
            str(STEPS),
            "--batch",
            str(batch),
            *"--checkpoint-every 1000 --out".split(),
            str(Path(tmp) / "run"),
        ]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        peak = [0]

        def sample() -> None:
            while proc.poll() is None:
                peak[0] = max(peak[0], job_pss(marker.encode()))
                time.sleep(0.02)

        watcher = threading.Thread(target=sample)
        watcher.start()
        _, err = proc.communicate(timeout=1800)
        watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{model} batch {batch} failed: {err.decode()[-500:]}")
    return {"model": model, "batch": batch, "peak_bytes": peak[0], **_estimate(model, batch)}


def _estimate(model: str, batch: int) -> dict:
    from netpart.cost.memory import BASE_BYTES
    from netpart.models import load_spec
    from netpart.partition import plan
    from netpart.planning.memory import estimate
    from netpart.train.config import TrainConfig

    spec = load_spec(model)
    config = TrainConfig.of(replicas=REPLICAS, shards=WORKERS, batch=batch, steps=STEPS)
    est = estimate(spec, plan(spec, WORKERS, seed=0, batch=batch), **config.memory_job(WORKERS))
    workers = REPLICAS * WORKERS
    return {
        "estimate_bytes": est.total,
        "workers_bytes": est.workers_bytes,
        "shards_bytes": est.shards_bytes,
        "worker_processes_estimate": workers * BASE_BYTES + est.workers_bytes,
    }


def main() -> int:
    ap = parser("memory_bench", __doc__)  # --quick: two small cases only
    args = ap.parse_args()
    rows = []
    print(f"{'case':<22} {'peak GiB':>9} {'estimate GiB':>13} {'estimate/peak':>14}")
    for model, batch in CASES[:2] if args.quick else CASES:
        r = measure(model, batch)
        r["ratio"] = r["estimate_bytes"] / r["peak_bytes"]
        rows.append(r)
        print(
            f"{model + ' b' + str(batch):<22} {r['peak_bytes'] / 2**30:>9.2f} "
            f"{r['estimate_bytes'] / 2**30:>13.2f} {r['ratio']:>14.2f}"
        )
    low = min(r["ratio"] for r in rows)
    print(
        f"lowest estimate/peak: {low:.2f} (must be >= {1 / 1.5:.2f}: the estimate at most 1.5x low)"
    )
    write_results(args.out, {"workers": WORKERS, "replicas": REPLICAS, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
