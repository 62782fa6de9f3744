"""A plan's PNG figures, returned as bytes (the CLI decides where they go): who owns each
unit of every image layer, each worker's load per layer, the halo traffic between workers,
methods compared, and a sweep's speedup.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from netpart.models.spec import BYTES_PER_VALUE
from netpart.partition.blocks import LayerBlocks
from netpart.partition.graph import UnitGraph
from netpart.partition.plans import PartitionPlan
from netpart.partition.volume import coverage, layer_traffic
from netpart.planning.report import method_label

__all__ = ["cluster_png", "figures", "sweep_png"]

SHOWN_GROUPS = 4  # channel groups drawn side by side where a layer's groups differ


def figures(
    graph: UnitGraph, plan: PartitionPlan, comparison: Sequence[PartitionPlan] = ()
) -> dict[str, bytes]:
    """PNG bytes: partition maps (image models), load per worker per layer, halo heatmap."""
    out: dict[str, bytes] = {}
    if any(graph.spec.layers[lb.index].is_spatial for lb in graph.layers):
        out["partition_map.png"] = _partition_map(graph, plan)
    out["load.png"] = _load(plan)
    out["halo_traffic.png"] = _halo(graph, plan)
    if comparison:
        out["compare.png"] = _compare_png(plan, comparison)
    return out


def _partition_map(graph: UnitGraph, plan: PartitionPlan) -> bytes:
    """One panel per image layer: the owner of each position (colour), positions no window
    of the layer above reads hatched grey, and the key of the colours."""
    spec, workers = graph.spec, plan.workers
    spatial = [lb for lb in graph.layers if spec.layers[lb.index].is_spatial]
    cols = min(5, len(spatial))
    rows = -(-len(spatial) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.3 * rows + 0.8), squeeze=False)
    for ax in axes.ravel()[len(spatial) :]:
        ax.axis("off")
    cmap = _worker_colours(workers)
    dead_any = False
    for ax, lb in zip(axes.ravel(), spatial, strict=False):
        shown, title = _groups(lb, plan.node_map)
        ax.imshow(shown, cmap=cmap, vmin=0, vmax=max(workers - 1, 1), interpolation="nearest")
        dead = _unread(graph, lb.index, plan.node_map, workers)
        if dead is not None and dead.any():
            dead_any = True
            k = (shown.shape[1] + 1) // (dead.shape[1] + 1)  # the groups drawn
            grey = _side_by_side([np.where(dead, 1.0, np.nan)] * k)
            ax.imshow(grey, cmap="Greys", vmin=0, vmax=1.5, alpha=0.8, interpolation="nearest")
        ax.set_title(f"{spec.layer_name(lb.index)} {lb.shape}\n{title}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    note = "; grey: positions no window of the layer above reads" if dead_any else ""
    fig.suptitle(
        f"{plan.model}: owner of each unit ({workers} workers, {plan.method}){note}", fontsize=10
    )
    _key(fig, cmap, workers)
    return _png(fig)


def _groups(lb: LayerBlocks, node_map: np.ndarray) -> tuple[np.ndarray, str]:
    """The owner image of a layer's positions: one channel group's when every group is owned
    alike (said in the title), else up to SHOWN_GROUPS side by side, a column apart."""
    owners = lb.owner_grid(node_map)  # [G, H, W]
    if lb.nc == 1:
        return owners[0], "one channel group"
    if (owners == owners[:1]).all():
        return owners[0], f"all {lb.nc} channel groups owned alike"
    k = min(lb.nc, SHOWN_GROUPS)
    shown = _side_by_side([owners[g].astype(float) for g in range(k)])
    return shown, f"channel groups 1-{k} of {lb.nc}, left to right"


def _side_by_side(images: list[np.ndarray]) -> np.ndarray:
    """Images of one height in a row, a blank column apart."""
    gap = np.full((images[0].shape[0], 1), np.nan)
    return np.concatenate([x for image in images for x in (image, gap)][:-1], axis=1)


def _unread(graph: UnitGraph, index: int, node_map: np.ndarray, workers: int):
    """[H, W] True where no window of layer `index` + 1 reads layer `index`'s position, or
    None for the last layer and before a dense one (it reads everything)."""
    if index + 1 >= len(graph.layers) or not graph.spec.layers[index + 1].is_spatial:
        return None
    covered, _ = coverage(graph, index + 1, node_map, workers)
    return ~covered.any(axis=(0, 1))


def _worker_colours(workers: int):
    """A colour a worker: tab20's without its two greys (grey marks the positions no window
    reads) up to 18 workers, a spectrum beyond."""
    if workers > 18:
        return plt.get_cmap("nipy_spectral")
    from matplotlib.colors import ListedColormap

    colours = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]
    return ListedColormap(colours[: max(workers, 2)])


def _key(fig, cmap, workers: int) -> None:
    """The colour of each worker: a legend up to 18 workers, a colour bar beyond."""
    if workers <= 18:
        handles = [
            Patch(color=cmap(w / max(workers - 1, 1)), label=f"worker {w}") for w in range(workers)
        ]
        fig.legend(handles=handles, loc="lower center", ncol=min(workers, 10), fontsize=8)
        return
    bar = fig.colorbar(
        plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, workers - 1)),
        ax=fig.axes,
        orientation="horizontal",
        fraction=0.03,
    )
    bar.set_label("worker")
    bar.ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _load(plan: PartitionPlan) -> bytes:
    flops = np.array([w.flops for w in plan.per_worker], dtype=np.float64).T  # [L, P]
    spread = np.array([ly.spread for ly in plan.layers], dtype=np.float64)
    rel = flops / (flops.sum(axis=1, keepdims=True) / spread[:, None])
    workers = plan.workers
    fig, ax = plt.subplots(figsize=(max(6, 0.12 * workers + 4), 0.4 * len(plan.layers) + 2))
    im = ax.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(plan.layers)), [ly.name for ly in plan.layers])
    ax.set_xlabel("worker")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("load per worker per layer (1.0 = fair share of the layer)")
    fig.colorbar(im, ax=ax)
    return _png(fig)


def _halo(graph: UnitGraph, plan: PartitionPlan) -> bytes:
    traffic = layer_traffic(graph, plan.node_map, plan.workers).sum(axis=0) * BYTES_PER_VALUE
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(traffic, cmap="magma", interpolation="nearest")
    ax.set_xlabel("receiving worker")
    ax.set_ylabel("sending worker")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("halo traffic, bytes per example (forward)")
    fig.colorbar(im, ax=ax)
    return _png(fig)


def _compare_png(plan: PartitionPlan, comparison: Sequence[PartitionPlan]) -> bytes:
    """Volume / bound on a log scale (an undefined ratio, traffic over a bound of 0, is marked
    rather than drawn) and predicted step per method."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [method_label(p) for p in comparison]
    ratio = np.array([p.metrics.volume_ratio for p in comparison])
    finite = np.isfinite(ratio)
    x = np.arange(len(comparison))
    a1.bar(x[finite], ratio[finite], color="tab:blue")
    a1.set_yscale("log")
    a1.axhline(1.0, color="k", lw=0.8, ls="--")
    top = ratio[finite].max() if finite.any() else 1.0
    for i in x[~finite]:
        a1.text(i, 1.0, "undefined\n(bound 0)", ha="center", va="bottom", fontsize=7, color="red")
    a1.set_ylim(0.9, max(2.0, top * 1.5))
    a1.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("volume / lower bound (log)")
    a2.bar(x, [p.metrics.predicted_step_s * 1e3 for p in comparison], color="tab:orange")
    a2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("predicted step (ms, log)")
    fig.suptitle(f"{plan.model} on {plan.workers} workers: methods compared")
    fig.tight_layout()
    return _png(fig)


def sweep_png(sweep) -> bytes:
    """Speedup against workers (log 2), the knee and the fastest count marked."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(sweep.counts, sweep.speedups, "o-", color="tab:blue", label="predicted speedup")
    ax.axvline(sweep.knee, color="tab:green", ls="--", label=f"knee: {sweep.knee} workers")
    if sweep.peak != sweep.knee:
        ax.axvline(sweep.peak, color="tab:red", ls=":", label=f"fastest: {sweep.peak}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("model workers")
    ax.set_ylabel(f"speedup over {sweep.counts[0]} worker(s)")
    ax.set_title(f"{sweep.model}: a doubling must gain {sweep.gain:g}x", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def cluster_png(advice) -> bytes:
    """Predicted samples/s of every layout (the recommended one marked), fastest first."""
    rows = advice.layouts[:30]
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(rows) + 1.5))
    colors = {"downpour": "tab:blue", "sync": "tab:orange", "allreduce": "tab:green"}
    y = np.arange(len(rows))[::-1]
    ax.barh(
        y,
        [f.samples_per_s for f in rows],
        color=[colors[f.layout.mode] for f in rows],
        hatch=["" if f.fits else "//" for f in rows],
    )
    ax.set_yticks(
        y,
        [str(f.layout) + (" (recommended)" if i == 0 else "") for i, f in enumerate(rows)],
        fontsize=7,
    )
    ax.set_xlabel("predicted samples/s")
    ax.set_title(f"{advice.model} on {advice.machines} machines", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
