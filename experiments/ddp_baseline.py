"""What a user would pick instead: PyTorch DistributedDataParallel (all-reduce) on the same
data-parallel job as netpart's synchronous SGD, side by side in one run.

Job: tiny-local on the bundled digits, R replicas of the whole model (one process each,
gloo, one thread), batch 32 per replica, SGD lr 0.1, the same replica-disjoint batches
(`netpart.data`). DDP averages the replicas' gradients with an all-reduce; netpart runs the
same arithmetic through parameter-server shards (`--mode sync --workers 1`), and also with
the model split over 2 workers (`--workers 2`). Reported: time per epoch (median step time x
steps per epoch) and held-out accuracy against wall time.

    python experiments/ddp_baseline.py            # R = 2 and 4, ~2 min here

Writes experiments/results/ddp.csv, ddp.json and ddp.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from netpart.compile.shards import ShardLayout
from netpart.data import load_data
from netpart.files import write_atomic
from netpart.models import build_reference, load_spec
from netpart.partition import build_unit_graph, plan
from netpart.train import train
from netpart.train.config import TrainConfig
from netpart.train.run_report import evaluate, read_metrics
from netpart.train.rundir import model_from_shards

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments._common
from experiments._common import save_figure, write_csv
from netpart.calibrate.emulated import free_port

RESULTS = Path(__file__).resolve().parent / "results"
MODEL, DATA, LR, BATCH = "tiny-local", "digits", 0.1, 32
POINTS = 15  # held-out evaluations per run


def _ddp_worker(rank: int, world: int, port: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = load_spec(MODEL)
    data = load_data(DATA, spec, 0)
    model = build_reference(spec, 0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    every = max(1, steps // POINTS)
    snaps, times = [], []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        s0 = time.perf_counter()
        x, y = data.batch(rank, world, step, BATCH, torch.float32)
        loss = model.loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # the all-reduce of the gradients
        opt.step()
        times.append(time.perf_counter() - s0)
        if rank == 0 and (step % every == 0 or step == steps):
            state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            snaps.append((time.perf_counter() - t0, step, state))  # numpy: sent by value
    if rank == 0:
        queue.put((times, snaps))
    dist.destroy_process_group()


def run_ddp(replicas: int, steps: int) -> tuple[list[float], list]:
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, replicas, port, steps, queue))
        for r in range(replicas)
    ]
    for p in procs:
        p.start()
    try:
        times, snaps = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return times, snaps


def run_netpart(replicas: int, workers: int, steps: int, out: Path):
    """(step times of replica 0, held-out curve rows, final held-out figures)."""
    spec = load_spec(MODEL)
    p = plan(spec, workers, "metis", seed=0, batch=BATCH)
    config = TrainConfig.of(
        replicas=replicas,
        shards=1,
        mode="sync",
        optimizer="sgd",
        lr=LR,
        steps=steps,
        batch=BATCH,
        data=DATA,
        checkpoint_every=10**9,
        snapshot_every=max(1, steps // POINTS),
    )
    run = out / f"netpart_sync_R{replicas}_N{workers}"
    shutil.rmtree(run, ignore_errors=True)
    summary = train(spec, p, config, run)
    lines = read_metrics(run)
    t0 = min(x["time"] - x["step_s"] for x in lines)
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, workers, 1)
    held = load_data(DATA, spec, 0).held_out_set()
    curve = []
    for snap in sorted((run / "snapshots").iterdir()):
        meta = json.loads((snap / "shard_0.json").read_text())
        state = model_from_shards(spec, p, config, snap, layout)
        res = evaluate(spec, state, *held)
        curve.append({"time_s": meta["time"] - t0, "step": meta["clock"], **res})
    step_s = [x["step_s"] for x in lines if x["replica"] == 0]
    return step_s, curve, summary.held_out


def plot(curves: list[dict], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name in dict.fromkeys(c["system"] for c in curves):
        pts = [c for c in curves if c["system"] == name]
        ax.plot(
            [c["time_s"] for c in pts], [c["accuracy"] for c in pts], "-o", markersize=3, label=name
        )
    ax.set(xlabel="wall time (s)", ylabel="held-out accuracy", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    labels = [f"{r['system']}\nR={r['replicas']}" for r in rows]
    bx.barh(labels, [r["epoch_s"] for r in rows])
    bx.set(xlabel="seconds per epoch (median step x steps per epoch)")
    bx.tick_params(axis="y", labelsize=7)
    fig.suptitle("Synchronous data parallelism: DDP all-reduce vs netpart's parameter server")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    spec = load_spec(MODEL)
    held = load_data(DATA, spec, 0).held_out_set()
    train_n = load_data(DATA, spec, 0).n
    rows, curves = [], []
    for r in (int(x) for x in args.replicas.split(",")):
        per_epoch = train_n / (r * BATCH)  # steps per epoch: each replica owns n / R examples
        times, snaps = run_ddp(r, args.steps)
        for t, step, arrays in snaps:
            res = evaluate(spec, {k: torch.from_numpy(v) for k, v in arrays.items()}, *held)
            curves.append({"system": f"DDP R={r}", "time_s": t, "step": step, **res})
        rows.append(
            {
                "system": "DDP (all-reduce)",
                "replicas": r,
                "workers": 1,
                "step_ms": 1e3 * float(np.median(times[3:])),
                "epoch_s": float(np.median(times[3:])) * per_epoch,
                "accuracy": curves[-1]["accuracy"],
            }
        )
        for n in (1, 2):
            step_s, curve, held_out = run_netpart(r, n, args.steps, args.out / "runs")
            name = f"netpart sync R={r} N={n}"
            curves += [{"system": name, **c} for c in curve]
            rows.append(
                {
                    "system": f"netpart sync, {n} worker(s)/replica",
                    "replicas": r,
                    "workers": n,
                    "step_ms": 1e3 * float(np.median(step_s[3:])),
                    "epoch_s": float(np.median(step_s[3:])) * per_epoch,
                    "accuracy": held_out["accuracy"],
                }
            )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "ddp.csv", rows)
    doc = {"steps": args.steps, "batch": BATCH, "lr": LR, "rows": rows, "ddp_curves": curves}
    write_atomic(args.out / "ddp.json", json.dumps(doc, indent=1).encode())
    for row in rows:
        print(
            f"R={row['replicas']} {row['system']:<32} step {row['step_ms']:6.1f} ms, epoch "
            f"{row['epoch_s']:5.2f} s, held-out accuracy {row['accuracy']:.3f}"
        )
    plot(curves, rows, args.out / "ddp.png")
    print(f"wrote {args.out}/ddp.csv, ddp.json, ddp.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
