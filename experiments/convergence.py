"""Figures 4/5 of the paper: held-out accuracy against wall time and samples, for one replica,
synchronous SGD with R replicas, Downpour SGD with R replicas (SGD, SGD with DC-ASGD
delay compensation, and Adagrad) and Sandblaster L-BFGS (full batch, 16 work units).

Every run trains tiny-local split over 2 model workers on scikit-learn's bundled digits
(`--data digits`, 359 held-out images) with `netpart train`'s library entry point, keeping a
snapshot of every shard every K updates (`snapshot_every`); afterwards each snapshot is
assembled into the reference model and evaluated on the held-out set. Time 0 is the start of
the first step.

    python experiments/convergence.py            # 12 runs x 2 seeds, ~9 min here
    python experiments/convergence.py --steps 100 --replicas 1,2

Writes experiments/results/convergence.csv, convergence.json and convergence.png; the runs'
directories go to experiments/results/runs/ (not committed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from netpart.compile.shards import ShardLayout
from netpart.data import load_data
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition import build_unit_graph, plan
from netpart.train import train
from netpart.train.config import TrainConfig
from netpart.train.run_report import evaluate, read_metrics
from netpart.train.rundir import model_from_shards

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments._common
from experiments._common import save_figure, write_csv

RESULTS = Path(__file__).resolve().parent / "results"
MODEL, WORKERS, DATA = "tiny-local", 2, "digits"
SNAPSHOTS = 40  # per run
TARGET = 0.95  # held-out accuracy whose first crossing the summary reports
SANDBLASTER_ITERATIONS = 15  # full-batch L-BFGS iterations (Armijo line search)


def algorithms(replicas: list[int]) -> list[dict]:
    """The runs: one replica (plain SGD), then sync SGD, Downpour SGD and Downpour Adagrad."""
    runs = [{"name": "1 replica SGD", "mode": "sync", "optimizer": "sgd", "lr": 0.1, "replicas": 1}]
    for r in (r for r in replicas if r > 1):
        runs.append(
            {
                "name": f"sync SGD R={r}",
                "mode": "sync",
                "optimizer": "sgd",
                "lr": 0.1,
                "replicas": r,
            }
        )
        runs.append(
            {
                "name": f"Downpour SGD R={r}",
                "mode": "downpour",
                "optimizer": "sgd",
                "lr": 0.1,
                "replicas": r,
            }
        )
    for r in (r for r in replicas if r > 1):  # DC-ASGD: Downpour SGD, stale pushes corrected
        runs.append(
            {
                "name": f"Downpour DC-ASGD R={r}",
                "mode": "downpour",
                "optimizer": "sgd",
                "lr": 0.1,
                "replicas": r,
                "dc_lambda": 0.5,
            }
        )
    for r in replicas:
        runs.append(
            {
                "name": f"Downpour Adagrad R={r}",
                "mode": "downpour",
                "optimizer": "adagrad",
                "lr": 0.05,
                "replicas": r,
            }
        )
    for r in (r for r in replicas if r > 1):  # full-batch L-BFGS, the batch in 16 work units
        runs.append(
            {
                "name": f"Sandblaster L-BFGS R={r}",
                "mode": "sandblaster",
                "optimizer": "lbfgs",
                "lr": 1.0,
                "replicas": r,
            }
        )
    return runs


def run_one(spec, p, layout, algo: dict, steps: int, batch: int, seed: int, out: Path):
    """Train one configuration and evaluate its snapshots: rows of (time, samples, accuracy)."""
    r = algo["replicas"]
    updates = steps if algo["mode"] == "sync" else steps * r  # per shard (one per worker)
    blaster = algo["mode"] == "sandblaster"
    if blaster:  # one update per evaluation of the whole training set
        batch, steps, updates = load_data(DATA, spec, seed).n, SANDBLASTER_ITERATIONS, SNAPSHOTS
    config = TrainConfig.of(
        replicas=r,
        shards=WORKERS,
        mode=algo["mode"],
        optimizer=algo["optimizer"],
        lr=algo["lr"],
        steps=steps,
        batch=batch,
        data=DATA,
        timeout=60,
        checkpoint_every=10**9,
        snapshot_every=max(1, updates // SNAPSHOTS),
        dc_lambda=algo.get("dc_lambda", 0.0),
        seed=seed,
        units=16,
    )
    run = out / (algo["name"].replace(" ", "_").replace("=", "") + f"_seed{seed}")
    shutil.rmtree(run, ignore_errors=True)
    summary = train(spec, p, config, run)
    if blaster:
        lines = [json.loads(x) for x in (run / "sandblaster.jsonl").read_text().splitlines()]
        t0 = lines[0]["time"] - lines[0]["elapsed_s"]
    else:
        lines = read_metrics(run)
        t0 = min(x["time"] - x["step_s"] for x in lines)
    held = load_data(DATA, spec, config.run.seed).held_out_set()
    rows = [{"time_s": 0.0, "samples": 0, **_scores(spec, held, _initial_state(spec, seed))}]
    for snap in sorted((run / "snapshots").iterdir()):
        metas = [json.loads(f.read_text()) for f in sorted(snap.glob("shard_*.json"))]
        if len(metas) != WORKERS:
            continue  # a snapshot some shard did not reach
        state = model_from_shards(spec, p, config, snap, layout)
        rows.append(
            {
                "time_s": float(np.mean([m["time"] for m in metas])) - t0,
                "samples": batch
                * (
                    int(metas[0]["updates"])
                    if blaster
                    else sum(int(v) for v in metas[0]["progress"].values())
                ),
                **_scores(spec, held, state),
            }
        )
    done = len(lines) * batch if blaster else batch * steps * r
    end = {"time_s": max(x["time"] for x in lines) - t0, "samples": done}
    rows.append({**end, "loss": summary.held_out["loss"], "accuracy": summary.held_out["accuracy"]})
    keys = {k: algo[k] for k in ("mode", "optimizer", "replicas")}
    return [{"run": algo["name"], "seed": seed, **keys, **row} for row in rows]


def _initial_state(spec, seed: int):
    from netpart.models.reference import build_reference

    return build_reference(spec, seed).state_dict()


def summarise(rows: list[dict]) -> list[dict]:
    """Per run and seed: the end, and the first snapshot at or above TARGET accuracy."""
    out = []
    for key in dict.fromkeys((r["run"], r["seed"]) for r in rows):
        pts = [r for r in rows if (r["run"], r["seed"]) == key]
        hit = next((r for r in pts if r["accuracy"] >= TARGET), None)
        out.append(
            {
                "run": key[0],
                "seed": key[1],
                "accuracy": pts[-1]["accuracy"],
                "time_s": pts[-1]["time_s"],
                "samples": pts[-1]["samples"],
                "time_to_target_s": hit["time_s"] if hit else None,
                "samples_to_target": hit["samples"] if hit else None,
            }
        )
    return out


def _scores(spec, held, state) -> dict:
    x, y = held
    result = evaluate(spec, state, x, y)
    return {"loss": result["loss"], "accuracy": result["accuracy"]}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    rows = [r for r in rows if r["seed"] == rows[0]["seed"]]  # one seed: readable curves
    runs = list(dict.fromkeys(r["run"] for r in rows))
    styles = {"sync": "--", "downpour": "-", "sandblaster": "-."}
    for name in runs:
        pts = [r for r in rows if r["run"] == name]
        style = styles.get(pts[0]["mode"], "-") if pts[0]["replicas"] > 1 else ":"
        marker = {"adagrad": "o", "lbfgs": "^"}.get(pts[0]["optimizer"], "s")
        for ax, key in zip(axes, ("time_s", "samples"), strict=True):
            ax.plot(
                [r[key] for r in pts],
                [r["accuracy"] for r in pts],
                style,
                marker=marker,
                markersize=3,
                label=name,
            )
    axes[0].set(xlabel="wall time (s)", ylabel="held-out accuracy")
    axes[1].set(xlabel="training examples processed (all replicas)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=250, help="steps per replica")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--seeds", default="0,1", help="weights and data order; one run each")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    spec = load_spec(MODEL)
    p = plan(spec, WORKERS, "metis", seed=0, batch=args.batch)
    layout = ShardLayout.build(build_unit_graph(spec, p.granularity), p.node_map, WORKERS, WORKERS)
    replicas = [int(r) for r in args.replicas.split(",")]
    rows: list[dict] = []
    seeds = [int(v) for v in args.seeds.split(",")]
    jobs = [(algo, seed) for seed in seeds for algo in algorithms(replicas)]
    for algo, seed in tqdm(jobs, desc="convergence", unit="run"):
        rows += run_one(spec, p, layout, algo, args.steps, args.batch, seed, args.out / "runs")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "convergence.csv", rows)
    summary = summarise(rows)
    doc = {
        "steps": args.steps,
        "batch": args.batch,
        "target": TARGET,
        "summary": summary,
        "rows": rows,
    }
    write_atomic(args.out / "convergence.json", json.dumps(doc, indent=1).encode())
    title = f"{MODEL} on {WORKERS} model workers, digits: held-out accuracy (2-core machine)"
    plot(rows, args.out / "convergence.png", title)
    for f in summary:
        hit = (
            f"{f['time_to_target_s']:.1f} s, {f['samples_to_target']:,} samples"
            if f["samples_to_target"] is not None
            else "never"
        )
        print(
            f"{f['run']:<22} seed {f['seed']}: accuracy {f['accuracy']:.3f} after "
            f"{f['time_s']:5.1f} s; {TARGET:.0%} after {hit}"
        )
    print(f"wrote {args.out}/convergence.csv, convergence.json, convergence.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
