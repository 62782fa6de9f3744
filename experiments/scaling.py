"""Figure 3 of the paper: speedup of one training step against the number of model workers.

For each model and N, plan with METIS (and baselines for contrast), execute every worker's
slice of every layer alone on one thread to measure its compute time (`netpart.calibrate.trace`),
and put the measurements on the plan's lockstep critical path with the halo bytes over a
network model (`netpart.partition.simulate`). Speedup = simulated step at N=1 / at N.

    python experiments/scaling.py                      # all models, ~10 min here
    python experiments/scaling.py --models speech,image-80m --workers 1,2,4,8

Slice timings are cached in experiments/results/traces/ (one .npz per model, method, N,
batch, holding a digest of the plan it timed: a plan that has changed since is timed again);
--fresh measures again. Writes experiments/results/scaling.csv, scaling.json,
scaling.png and scaling.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from netpart.calibrate.trace import SliceTimes, measure_slices
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition import plan
from netpart.partition.cost import NetworkModel
from netpart.partition.figures import reevaluate
from netpart.partition.schedule import plan_schedule
from netpart.partition.simulate import simulate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments._common
from experiments._common import save_figure, write_csv

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("speech", "image-80m", "image-330m", "image-1.7b")
WORKERS = (1, 2, 4, 8, 16, 32, 64, 81, 128)
CONTRAST = {"speech": ("stripe",), "image-80m": ("tiles", "stripe")}
NETWORKS = {
    "1 Gbit/s": NetworkModel(bandwidth_bps=1e9, latency_s=50e-6),
    "10 Gbit/s": NetworkModel(bandwidth_bps=10e9, latency_s=20e-6),
    "1 Gbit/s, 8-core workers": NetworkModel(bandwidth_bps=1e9, latency_s=50e-6),
}
# Scenario: machines like the paper's, each worker 8x faster than one measured core (ideal
# multi-threading: an assumption, not a measurement).
COMPUTE_SCALE = {"1 Gbit/s, 8-core workers": 1 / 8}
PAPER = {"speech": (8, 2.2, "speech: 2.2x at 8 machines"),
         "image-1.7b": (81, 12.0, "1.7B image model: >12x at 81")}  # fmt: skip


def plan_digest(p) -> str:
    """What the slice timings depend on: the node map and the graph it indexes."""
    h = hashlib.sha256(p.node_map.astype(np.int64).tobytes())
    h.update(json.dumps(p.granularity.to_dict(), sort_keys=True).encode())
    return h.hexdigest()


def traced(spec, method: str, workers: int, batch: int, cache: Path, fresh: bool, bar):
    """(plan, slice times), the times from the cache unless `fresh` or the plan changed."""
    p = plan(spec, workers, method, seed=0, batch=batch)
    path = cache / f"{spec.name}_{method}_{workers}_b{batch}.npz"
    digest = plan_digest(p)
    if path.exists() and not fresh:
        with np.load(path) as f:
            if "plan_digest" in f and str(f["plan_digest"]) == digest:
                return p, SliceTimes.from_arrays(f)

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 10) == 0:
            bar.set_postfix_str(f"{spec.name} {method} N={workers}: slice {done}/{total}")

    times = measure_slices(spec, p, batch, on_slice=progress)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **times.to_arrays(), plan_digest=np.array(digest))
    tmp.replace(path)
    return p, times


def calibrated(profile: NetworkModel, net_name: str, net: NetworkModel) -> NetworkModel:
    """The profile's machines (slice tables, fixed costs) on the scenario's links (the
    measured link, collective and crowd tables dropped: the emulated machines' shared host is
    not the cluster's), every worker on a machine of its own (halo hidden behind interior
    compute)."""
    scenario = replace(profile, bandwidth_bps=net.bandwidth_bps, latency_s=net.latency_s,
                       link={}, gather=(), crowd=(), overlap=True)  # fmt: skip
    return scenario.faster(1 / COMPUTE_SCALE.get(net_name, 1.0))  # as `--net speed=`


def modelled(spec, method: str, n: int, batch: int, profile: NetworkModel) -> list[dict]:
    """The rows of one plan predicted by the calibrated step-time model (no slice timings)."""
    p = plan(spec, n, method, seed=0, batch=batch)
    rows = []
    for net_name, net in NETWORKS.items():
        m = reevaluate(spec, p, batch, calibrated(profile, net_name, net)).metrics
        rows.append({
            "model": spec.name, "method": method, "workers": n, "network": net_name,
            "step_s": m.predicted_step_s, "compute_s": m.compute_s,
            "exchange_s": m.exchange_s, "halo_mb": 2 * m.volume * batch * 4 / 1e6,
            "imbalance": m.max_layer_imbalance, "seconds": 0.0,
        })  # fmt: skip
    return rows


def run(models, workers, batch: int, out: Path, fresh: bool, profile=None) -> list[dict]:
    jobs = [(m, meth, n) for m in models for meth in ("metis", *CONTRAST.get(m, ()))
            for n in workers]  # fmt: skip
    rows = []
    with tqdm(jobs, desc="scaling", unit="plan") as bar:
        for model, method, n in bar:
            spec = load_spec(model)
            if profile is not None:
                rows += modelled(spec, method, n, batch, profile)
                continue
            t0 = time.perf_counter()
            p, times = traced(spec, method, n, batch, out / "traces", fresh, bar)
            _, schedule = plan_schedule(spec, p, validate=False)
            traffic = schedule.traffic()
            for net_name, net in NETWORKS.items():
                scale = COMPUTE_SCALE.get(net_name, 1.0)
                fwd, bwd = times.forward * scale, times.backward * scale
                sim = simulate_step(fwd, bwd, traffic, batch, net)
                rows.append({
                    "model": model, "method": method, "workers": n, "network": net_name,
                    "step_s": sim.step_s, "compute_s": sim.compute_s,
                    "exchange_s": sim.exchange_s + sim.loss_s,
                    "halo_mb": 2 * float(traffic.sum()) * batch * 4 / 1e6,
                    "imbalance": float(_imbalance(times)), "seconds": time.perf_counter() - t0,
                })  # fmt: skip
    base = {(r["model"], r["method"], r["network"]): r["step_s"] for r in rows if r["workers"] == 1}
    for r in rows:
        one = base.get((r["model"], "metis", r["network"]))
        r["speedup"] = one / r["step_s"] if one else float("nan")
    return rows


def _imbalance(times: SliceTimes) -> float:
    """Measured: sum over layers of the slowest slice over sum of the mean slice."""
    t = times.forward + times.backward
    return t.max(axis=1).sum() / max(t.mean(axis=1).sum(), 1e-12)


def plot(rows: list[dict], path: Path, how: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(NETWORKS)
    fig, axes = plt.subplots(1, len(nets), figsize=(5.5 * len(nets), 4.6), sharey=True)
    colors = {}
    for ax, net in zip(axes, nets, strict=True):
        for (model, method), pts in _curves(rows, net).items():
            ns, sp = zip(*pts, strict=True)
            style = "-o" if method == "metis" else ":"
            label = model if method == "metis" else f"{model} ({method})"
            kw = {"color": colors[model]} if model in colors else {}
            (ln,) = ax.plot(ns, sp, style, markersize=3, label=label, **kw)
            colors.setdefault(model, ln.get_color())
        for model, (n, s, text) in PAPER.items():
            if model in colors:
                ax.plot([n], [s], marker="*", markersize=14, color=colors[model],
                        markeredgecolor="black", linestyle="none")  # fmt: skip
                ax.annotate(text, (n, s), textcoords="offset points", xytext=(-60, 8),
                            fontsize=8)  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="model workers (machines)", title=net)
        ax.set_xticks(WORKERS, [str(n) for n in WORKERS])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("speedup of one step over 1 worker")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"Speedup of one step, {how} (stars: the paper's Figure 3)")
    fig.tight_layout()
    save_figure(fig, path)


def _curves(rows, net):
    out: dict[tuple[str, str], list] = {}
    for r in rows:
        if r["network"] == net:
            out.setdefault((r["model"], r["method"]), []).append((r["workers"], r["speedup"]))
    return {k: sorted(v) for k, v in out.items()}


def summary(rows: list[dict]) -> dict:
    """Per model and network (metis): where the speedup peaks, and its value there."""
    out = {}
    for net in NETWORKS:
        for (model, method), pts in _curves(rows, net).items():
            if method != "metis":
                continue
            n, s = max(pts, key=lambda p: p[1])
            out.setdefault(model, {})[net] = {
                "peak_workers": n, "peak_speedup": s, "curve": dict(pts),
            }  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--fresh", action="store_true", help="measure slices again")
    ap.add_argument("--profile", type=Path, default=None,
                    help="predict with this calibrated profile's model (e.g. results/"
                    "emulated_profile.json from validate_sim.py) instead of simulating "
                    "measured slice times; writes scaling_calibrated.*")  # fmt: skip
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    workers = [int(n) for n in args.workers.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    profile = None
    if args.profile is not None:
        profile = NetworkModel.from_profile(args.profile.read_text(), args.profile.name)
    rows = run(models, workers, args.batch, args.out, args.fresh, profile)
    name = "scaling" if profile is None else "scaling_calibrated"
    write_csv(args.out / f"{name}.csv", rows)
    result = {"batch": args.batch, "networks": {k: v.to_dict() for k, v in NETWORKS.items()},
              "profile": None if profile is None else profile.to_dict(),
              "peaks": summary(rows), "rows": rows}  # fmt: skip
    write_atomic(args.out / f"{name}.json", json.dumps(result, indent=1).encode())
    how = "simulated from measured slice times"
    if profile is not None:
        how = f"predicted by the model calibrated on emulated machines ({args.profile.name})"
    plot(rows, args.out / f"{name}.png", how)
    for model, nets in result["peaks"].items():
        for net, peak in nets.items():
            print(f"{model:<11} {net:<9} peak {peak['peak_speedup']:6.2f}x at "
                  f"{peak['peak_workers']} workers")  # fmt: skip
    print(f"wrote {args.out}/{name}.csv, {name}.json, {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
