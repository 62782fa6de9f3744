"""Figure 3 of the paper: speedup of one training step against the number of model workers,
predicted for a machine described by its figures (`experiments/machines/*.toml`).

For each model and worker count, plan (auto, seed 0) and predict the step on the machine;
speedup = predicted step at 1 worker / at N. The band re-predicts the same plans on the machine
with its compute rate x/÷ 2. Nothing is measured on this host: the same machine file draws the
same curves anywhere, any day.

    python experiments/scaling.py                      # paper-2012, all models, ~3 min here
    python experiments/scaling.py --machine experiments/machines/this-host.toml
    python experiments/scaling.py --fit speech@8=2.2 --machine BASE.toml --write-machine OUT.toml

`--fit MODEL@N=S` finds the compute rate (every kind scaled alike) at which MODEL's predicted
speedup at N workers is S, writes the machine with it, and draws with it. Writes
results/figure3.json, figure3.csv, figure3.png and figure3.md (the paper against netpart).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from netpart.cost.sheet import MachineSheet, read_sheet, sheet_toml
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.partition import plan
from netpart.partition.evaluate import reevaluate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments._common
from experiments._common import save_figure, write_csv

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAPER_MACHINE = HERE / "machines" / "paper-2012.toml"
MODELS = ("speech", "image-80m", "image-330m", "image-1.7b")
WORKERS = (1, 2, 4, 8, 16, 32, 64, 81, 128)
BAND = 2.0  # the band: the compute rate x/÷ this
# The paper's numbers for Figure 3, as its text states them (section 5); the figure's other
# points are drawn, not printed.
PAPER = (
    {"model": "speech", "workers": 8, "speedup": 2.2, "claim": "2.2x at 8 machines (its peak)"},
    {"model": "image-1.7b", "workers": 81, "speedup": 12.0, "claim": "more than 12x at 81"},
)


def curves(
    machine: MachineSheet, models, counts, batch: int = 32, band: float = BAND
) -> list[dict]:
    """One row per model and worker count: the predicted step on `machine`, its speedup over
    1 worker, and the speedups with the compute rate x/÷ `band` (the same plans)."""
    nets = {
        "": machine.to_machine(),
        "slow": machine.faster(1 / band).to_machine(),
        "fast": machine.faster(band).to_machine(),
    }
    rows = []
    for model in models:
        spec = load_spec(model)
        one: dict[str, float] = {}
        for n in sorted(counts):
            p = plan(spec, n, seed=0, batch=batch, network=nets[""])
            steps = {
                k: reevaluate(spec, p, batch, net).metrics.predicted_step_s
                for k, net in nets.items()
            }
            if n == 1:
                one = steps
            rows.append(
                {
                    "model": model,
                    "workers": n,
                    "method": p.method,
                    "step_s": steps[""],
                    "speedup": one[""] / steps[""],
                    "band_low": min(one[k] / steps[k] for k in nets),
                    "band_high": max(one[k] / steps[k] for k in nets),
                    "halo_mb": 2 * p.metrics.volume * batch * 4 / 1e6,
                }
            )
    return rows


def speedup_at(machine: MachineSheet, model: str, n: int, batch: int) -> float:
    spec = load_spec(model)
    net = machine.to_machine()
    one = plan(spec, 1, seed=0, batch=batch, network=net).metrics.predicted_step_s
    return one / plan(spec, n, seed=0, batch=batch, network=net).metrics.predicted_step_s


def fit_rate(machine: MachineSheet, model: str, n: int, target: float, batch: int) -> MachineSheet:
    """`machine` with the compute rate (every kind alike) at which `model`'s speedup at `n`
    workers is `target`: bisection on the rate's logarithm (a faster machine computes less
    per byte it sends, so its speedup is lower)."""
    lo, hi = math.log(1 / 256), math.log(256)
    if not speedup_at(machine.faster(math.exp(hi)), model, n, batch) <= target:
        raise SystemExit(f"--fit: {model} is faster than {target}x at {n} on any rate tried")
    if not speedup_at(machine.faster(math.exp(lo)), model, n, batch) >= target:
        raise SystemExit(f"--fit: {model} cannot reach {target}x at {n} on this machine")
    for _ in range(40):
        mid = (lo + hi) / 2
        if speedup_at(machine.faster(math.exp(mid)), model, n, batch) > target:
            lo = mid
        else:
            hi = mid
    return machine.faster(math.exp((lo + hi) / 2))


def table(rows: list[dict]) -> str:
    """The paper's stated points against netpart's, and each model's peak."""
    at = {(r["model"], r["workers"]): r for r in rows}
    lines = ["| model | paper | netpart at that count | band (rate x/÷ 2) |", "|---|---|---|---|"]
    for p in PAPER:
        r = at.get((p["model"], p["workers"]))
        if r is not None:
            lines.append(
                f"| {p['model']} | {p['claim']} | {r['speedup']:.2f}x | "
                f"{r['band_low']:.2f}-{r['band_high']:.2f}x |"
            )
    lines += [
        "",
        "| model | " + " | ".join(str(n) for n in _counts(rows)) + " | peak |",
        "|---|" + "---|" * (len(_counts(rows)) + 1),
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        best = max(mine, key=lambda r: r["speedup"])
        cells = " | ".join(f"{r['speedup']:.2f}" for r in mine)
        lines.append(f"| {model} | {cells} | {best['speedup']:.2f}x at {best['workers']} |")
    return "\n".join(lines) + "\n"


def _counts(rows: list[dict]) -> list[int]:
    return sorted({r["workers"] for r in rows})


def plot(rows: list[dict], machine: MachineSheet, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        ns = [r["workers"] for r in mine]
        (line,) = ax.plot(ns, [r["speedup"] for r in mine], "-o", markersize=3, label=model)
        ax.fill_between(
            ns,
            [r["band_low"] for r in mine],
            [r["band_high"] for r in mine],
            color=line.get_color(),
            alpha=0.15,
            linewidth=0,
        )
        for p in PAPER:
            if p["model"] == model:
                ax.plot(
                    [p["workers"]],
                    [p["speedup"]],
                    marker="*",
                    markersize=15,
                    color=line.get_color(),
                    markeredgecolor="black",
                    linestyle="none",
                )
                ax.annotate(
                    f"paper: {p['claim']}",
                    (p["workers"], p["speedup"]),
                    textcoords="offset points",
                    xytext=(-150, 10),
                    fontsize=8,
                )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="machines per model instance (model workers)",
        ylabel="speedup of one step over 1 machine",
    )
    ax.set_xticks(_counts(rows), [str(n) for n in _counts(rows)])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(
        f"Figure 3 on {machine.name} (band: compute rate x/÷ {BAND:g}; stars: paper)", fontsize=10
    )
    fig.tight_layout()
    save_figure(fig, path)


def parse_fit(text: str) -> tuple[str, int, float]:
    m = re.fullmatch(r"([\w.-]+)@(\d+)=([0-9.]+)", text.strip())
    if not m:
        raise SystemExit(f"--fit {text!r}: give MODEL@WORKERS=SPEEDUP, e.g. speech@8=2.2")
    return m.group(1), int(m.group(2)), float(m.group(3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", type=Path, default=PAPER_MACHINE)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--fit", default=None, metavar="MODEL@N=S")
    ap.add_argument(
        "--write-machine", type=Path, default=None, help="--fit: write the fitted machine here"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    machine = read_sheet(args.machine)
    if args.fit:
        model, n, target = parse_fit(args.fit)
        machine = fit_rate(machine, model, n, target, args.batch)
        if args.write_machine is not None:  # drawn as the file states it (6 figures)
            write_atomic(args.write_machine, sheet_toml(machine).encode())
            machine = read_sheet(args.write_machine)
            print(f"wrote {args.write_machine}")
        print(
            f"fitted: {machine.flops_per_s / 1e9:.4g} GFLOP/s per worker puts {model} at "
            f"{speedup_at(machine, model, n, args.batch):.3f}x on {n}"
        )
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    counts = [int(n) for n in args.workers.split(",")]
    rows = curves(machine, models, counts, args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "figure3.csv", rows)
    result = {"machine": machine.to_dict(), "batch": args.batch, "paper": list(PAPER), "rows": rows}
    write_atomic(args.out / "figure3.json", json.dumps(result, indent=1).encode())
    write_atomic(args.out / "figure3.md", table(rows).encode())
    plot(rows, machine, args.out / "figure3.png")
    print(table(rows))
    print(f"wrote {args.out}/figure3.csv, figure3.json, figure3.md, figure3.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
