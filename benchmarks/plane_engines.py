"""Mt-KaHyPar against METIS on the layer-aligned graph (the trial issue 18 asked for).

Both engines partition the same plane (`netpart.partition.plane.build_plane`); netpart then
maps blocks, repairs balance and lets pools' inputs follow exactly as `metis-aligned` does.
Mt-KaHyPar gets the plane as a hypergraph, one net per cell over the cell and its 8
neighbours, and minimises connectivity (lambda - 1): the number of other workers that need a
cell's values, the halo DistBelief counts. Its balance model is one weight per vertex, which
fits here because the plane's per-layer constraints coincide on the zoo models (one column).
mtkahypar is installed by this script into its own environment, never into netpart's.

    python benchmarks/plane_engines.py --out benchmarks/results/plane_engines.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = ROOT / "benchmarks" / ".kahypar-venv"  # gitignored
POINTS = [(m, p) for m in ("image-80m", "image-330m", "image-1.7b") for p in (16, 64, 128)]


def ensure_engine() -> Path:
    """site-packages of an environment holding mtkahypar (made once)."""
    python = ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, "mtkahypar==1.7.post1"], check=True)
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _kahypar_owner(mk, plane, workers: int, imbalance: float) -> tuple:
    import mtkahypar
    import numpy as np

    ids = np.arange(plane.cells).reshape(plane.ny, plane.nx)
    nets = [
        ids[max(0, y - 1) : y + 2, max(0, x - 1) : x + 2].ravel().tolist()
        for y in range(plane.ny)
        for x in range(plane.nx)
    ]
    ctx = mk.context_from_preset(mtkahypar.PresetType.DEFAULT)
    ctx.set_partitioning_parameters(workers, imbalance, mtkahypar.Objective.KM1)
    ctx.logging = False
    weights = np.maximum(1, plane.vwgt[:, 0] // 10_000).tolist()  # its weights are 32-bit sums
    start = time.perf_counter()
    hg = mk.create_hypergraph(ctx, plane.cells, len(nets), nets, weights, [1] * len(nets))
    part = hg.partition(ctx)
    owner = np.array([part.block_id(v) for v in range(plane.cells)], dtype=np.int64)
    return owner, time.perf_counter() - start


def _one(mk, model: str, workers: int) -> dict:
    import numpy as np

    from netpart.cost.step import NetworkModel
    from netpart.models import load_spec
    from netpart.partition import plan
    from netpart.partition.balance import follow_pools, quantile_cut, rebalance
    from netpart.partition.blocks import Granularity
    from netpart.partition.evaluate import evaluate
    from netpart.partition.graph import build_unit_graph
    from netpart.partition.plane import blocks_from_plane, build_plane

    spec = load_spec(model)
    start = time.perf_counter()
    metis = plan(spec, workers, "metis-aligned").metrics
    metis_wall = time.perf_counter() - start
    g = build_unit_graph(spec, replace(Granularity.for_workers(workers), align_pools=True))
    spatial = [lb for lb in g.layers if spec.layers[lb.index].is_spatial]
    plane = build_plane(spec)
    owner, wall = _kahypar_owner(mk, plane, workers, 0.03)
    out = np.empty(g.num_vertices, dtype=np.int64)
    blocks_from_plane(g, plane, owner, workers, out)
    share = np.full(workers, 1.0 / workers)
    for lb in g.layers[len(spatial) :]:
        out[lb.ids] = quantile_cut(g.flops[lb.ids].astype(np.float64), share)
    out = follow_pools(g, rebalance(g, out, workers, 0.03), workers, share)
    km1, _, _ = evaluate(g, out, workers, 32, NetworkModel())
    return {
        "model": model,
        "workers": workers,
        "metis": {
            "volume_ratio": metis.volume_ratio,
            "imbalance": metis.max_layer_imbalance,
            "step_s": metis.predicted_step_s,
            "plan_wall_s": metis_wall,
        },
        "mtkahypar": {
            "volume_ratio": km1.volume_ratio,
            "imbalance": km1.max_layer_imbalance,
            "step_s": km1.predicted_step_s,
            "partition_wall_s": wall,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = ap.parse_args()
    sys.path.append(str(ensure_engine()))
    import mtkahypar

    mk = mtkahypar.initialize(2)
    rows = []
    print(f"{'model':<12} {'P':>4} {'METIS vol/bound':>16} {'Mt-KaHyPar':>11} {'KaHyPar s':>10}")
    for model, workers in POINTS:
        r = _one(mk, model, workers)
        rows.append(r)
        print(
            f"{model:<12} {workers:>4} {r['metis']['volume_ratio']:>16.3f} "
            f"{r['mtkahypar']['volume_ratio']:>11.3f} {r['mtkahypar']['partition_wall_s']:>10.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
