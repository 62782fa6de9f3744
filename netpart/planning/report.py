"""Plan reports: console tables and `report.md`, returned as text (the PNG figures are
`netpart.planning.pictures`). Nothing here writes files; the CLI decides where text goes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from netpart.compile.shards import ShardLayout
from netpart.models.spec import BYTES_PER_VALUE, ModelSpec
from netpart.partition.planner import TIE
from netpart.partition.plans import PartitionPlan

__all__ = [
    "auto_reason",
    "auto_table",
    "cluster_markdown",
    "cluster_table",
    "compare_table",
    "layer_table",
    "method_label",
    "report_markdown",
    "shard_table",
    "summary_line",
    "sweep_table",
]


def _fmt_ratio(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{x:.2f}"


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def weighted_imbalance(plan: PartitionPlan) -> float:
    """The slowest workers' compute summed over layers over the mean worker's: each layer's
    imbalance weighted by what it costs (a 10-unit output layer that costs nothing does not
    set it, as it sets the worst layer's)."""
    slowest = sum(ly.compute_s for ly in plan.layers)
    mean = sum(ly.compute_s / ly.imbalance for ly in plan.layers if ly.imbalance > 0)
    return slowest / mean if mean > 0 else plan.metrics.max_layer_imbalance


def summary_line(plan: PartitionPlan) -> str:
    m = plan.metrics
    return (
        f"{plan.model} on {plan.workers} workers ({plan.method}): "
        f"volume {m.volume:,} values/example "
        f"({_fmt_ratio(m.volume_ratio)} x lower bound {m.lower_bound:,}), "
        f"imbalance {weighted_imbalance(plan):.3f} weighted by layer cost "
        f"(worst layer {m.max_layer_imbalance:.3f}), "
        f"predicted step {m.predicted_step_s * 1e3:.1f} ms at batch {plan.batch} "
        f"({plan.network.describe()})"
    )


def layer_table(plan: PartitionPlan, spec: ModelSpec | None = None) -> str:
    """The per-layer figures; for a layer graph (`spec` given, its layers branching) a
    `reads` column draws the graph: the layers each one reads."""
    rows = []
    for i, ly in enumerate(plan.layers):
        ratio = ly.volume / ly.lower_bound if ly.lower_bound else float("nan")
        note = "" if ly.blocks >= plan.workers else f" (on {ly.workers_used} of {plan.workers})"
        rows.append(
            [
                ly.name,
                ly.shape,
                f"{ly.blocks}{note}",
                f"{ly.volume:,}",
                f"{ly.lower_bound:,}",
                _fmt_ratio(ratio) if ly.lower_bound else ("—" if ly.volume else "0"),
                f"{ly.imbalance:.3f}",
                f"{ly.compute_s * 1e3:.2f}",
                f"{ly.exchange_s * 1e3:.2f}",
                split_label(ly),
                "-" if ly.convolved is None else f"{ly.convolved:.0%}",
            ]
        )
        if spec is not None and not spec.is_chain:
            reads = ", ".join("input" if s < 0 else str(s) for s in spec.sources(i))
            rows[-1].insert(1, reads)
    headers = ["layer", "shape", "blocks", "volume", "bound", "vol/bound", "imbalance"]
    if spec is not None and not spec.is_chain:
        headers.insert(1, "reads")
    more = ["compute ms", "exposed exchange ms", "split", "by convolution"]
    table = _table([*headers, *more], rows)
    return table + "\n\n" + EXPOSED_NOTE


def split_label(layer) -> str:
    """Whether a layer is split to hide its halo across machines, and the work it could
    hide behind: "yes (4.1 ms)", "no (0.3 ms)", or "-" where a split hides nothing."""
    if layer.hideable_s <= 0:
        return "-"
    return f"{'yes' if layer.split else 'no'} ({layer.hideable_s * 1e3:.1f} ms)"


EXPOSED_NOTE = (
    "(volume: values per example a layer receives; exposed exchange: the part of its halo's "
    "time the step waits for, the rest travelling while interior units compute, so a layer "
    "that moves values can show 0.00; split: whether workers on machines of their own split "
    "the layer to hide its halo, which pays when the halo's time exceeds what splitting adds "
    "to the work beside it, in brackets; by convolution: the share of a conv layer's outputs "
    "torch's own convolution computes, on each worker's rectangles of the plane, the rest "
    "multiplying gathered patches where the cut is irregular)"
)


def method_label(p: PartitionPlan) -> str:
    extra = "".join(f" {k}={v}" for k, v in p.method_options.items() if k == "bands")
    return f"auto: {p.method}{extra}" if p.candidates else f"{p.method}{extra}"


def compare_table(plans: Sequence[PartitionPlan]) -> str:
    rows = [
        [
            method_label(p),
            f"{p.metrics.volume:,}",
            _fmt_ratio(p.metrics.volume_ratio),
            f"{p.metrics.max_layer_imbalance:.3f}",
            f"{p.metrics.edge_cut:,}",
            f"{p.metrics.predicted_step_s * 1e3:.1f}",
        ]
        for p in plans
    ]
    headers = ["method", "volume", "vol/bound", "max imbalance", "edge cut", "step ms"]
    return _table(headers, rows)


def auto_table(plan: PartitionPlan) -> str:
    """The candidates `auto` weighed, the chosen one marked, and one line saying why it won."""
    rows = []
    for c in plan.candidates:
        m = c.metrics
        chosen = c.method == plan.method and c.options == plan.method_options
        rows.append(
            [
                ("* " if chosen else "")
                + c.method
                + "".join(f" {k}={v}" for k, v in c.options.items()),
                _fmt_ratio(m.volume_ratio),
                f"{m.max_layer_imbalance:.3f}",
                f"> {m.predicted_step_s * 1e3:.2f}"
                if c.skipped
                else f"{m.predicted_step_s * 1e3:.2f}",
            ]
        )
    table = _table(["candidate", "vol/bound", "max imbalance", "step ms"], rows)
    notes = [f"{c.method}: not evaluated, {c.skipped}" for c in plan.candidates if c.skipped]
    return "\n".join([table, *notes, auto_reason(plan)])


def auto_reason(plan: PartitionPlan) -> str:
    """Why `auto` kept this plan, in one sentence."""
    steps = sorted(c.metrics.predicted_step_s for c in plan.candidates if not c.skipped)
    mine = plan.metrics.predicted_step_s
    if mine == steps[0]:
        runner_up = steps[1] if len(steps) > 1 else mine
        return (
            f"auto chose {plan.method}: the fastest predicted step, {mine * 1e3:.2f} ms "
            f"(next {runner_up * 1e3:.2f} ms)."
        )
    return (
        f"auto chose {plan.method}: predicted step {mine * 1e3:.2f} ms, within "
        f"{TIE:.0%} of the fastest ({steps[0] * 1e3:.2f} ms), and the least volume of those "
        f"({_fmt_ratio(plan.metrics.volume_ratio)} x the bound)."
    )


def report_markdown(
    spec: ModelSpec,
    plan: PartitionPlan,
    comparison: Sequence[PartitionPlan] = (),
    figure_names: Sequence[str] = (),
    shards: ShardLayout | None = None,
) -> str:
    """The plan's `report.md`: summary, how auto chose, layers, workers, shards, methods
    compared, figures."""
    lines = _summary_lines(spec, plan)
    if plan.candidates:
        lines += ["## How auto chose", "", auto_table(plan), ""]
    lines += ["## Layers", "", layer_table(plan, spec), ""]
    lines += [
        "Volume counts each unit once per remote worker that reads it (forward pass; the "
        "backward pass sends as many gradients back; in a layer graph, once for each layer "
        "that reads it). The bound per layer: dense layers all-gather their input, (q-1)·n; "
        "spatial layers need the halo of the best regular tiling into q tiles, q being the "
        "number of workers the plan spreads the layer over; a merge or a batch norm, placed "
        "with its inputs, sends nothing (0).",
        "",
        "## Workers",
        "",
        _worker_table(plan),
        "",
    ]
    if shards is not None:
        lines += [
            f"## Parameter server: {shards.shards} shards",
            "",
            "Every replica's worker w pushes to and fetches from the shards listed for it; "
            "bytes are float32 values, one push (or fetch) per worker.",
            "",
            shard_table(shards),
            "",
        ]
    if comparison:
        lines += ["## Methods compared", "", compare_table(comparison), ""]
    if figure_names:
        lines += ["## Figures", ""] + [f"![{n}]({n})" for n in figure_names] + [""]
    return "\n".join(lines)


def _summary_lines(spec: ModelSpec, plan: PartitionPlan) -> list[str]:
    """The report's title, the plan's provenance and its summary figures."""
    m, net = plan.metrics, plan.network
    lines = [
        f"# Partition plan: {plan.model} on {plan.workers} workers",
        "",
        f"- model: `{plan.model}` (fingerprint `{plan.fingerprint}`), "
        f"{spec.num_params:,} parameters, {len(spec.layers)} layers",
        f"- method: `{plan.method}`, seed {plan.seed}, options `{plan.options}`",
        f"- blocks: {len(plan.node_map):,}",
        f"- network model: {_si(net.bandwidth_bps, 'bit/s')}, latency "
        f"{net.latency_s * 1e6:.0f} µs, {_si(net.flops_per_s, 'FLOP/s')} per worker; "
        f"batch {plan.batch}",
        "",
        "## Summary",
        "",
        f"- **volume**: {m.volume:,} activation values per example per forward pass "
        f"({m.volume * BYTES_PER_VALUE * plan.batch / 1e6:.2f} MB per step each way)",
        f"- **lower bound**: {m.lower_bound:,} (volume / bound = {_fmt_ratio(m.volume_ratio)})",
        f"- **imbalance**: {weighted_imbalance(plan):.3f} (the slowest workers' compute over "
        "the mean worker's, summed over layers: each layer weighted by its cost); the worst "
        f"layer's, unweighted: {m.max_layer_imbalance:.3f} (its slowest worker's FLOPs over "
        "the mean)",
        f"- **edge cut**: {m.edge_cut:,} units read across workers",
        f"- **predicted step time**: {m.predicted_step_s * 1e3:.2f} ms "
        f"(compute {m.compute_s * 1e3:.2f} ms + exchange {m.exchange_s * 1e3:.2f} ms)",
        "",
    ]
    small = [ly for ly in plan.layers if ly.blocks < plan.workers]
    if small:
        names = ", ".join(f"{ly.name} ({ly.blocks} blocks)" for ly in small)
        lines += [
            f"Layers with fewer blocks than workers are spread over a subset of them: {names}.",
            "",
        ]
    return lines


def _worker_table(plan: PartitionPlan) -> str:
    rows = [
        [
            str(w.worker),
            _si(sum(w.flops), "FLOP"),
            f"{w.params:,}",
            _si(w.halo_in_bytes, "B"),
            _si(w.halo_out_bytes, "B"),
            str(len(w.neighbours)),
        ]
        for w in plan.per_worker
    ]
    headers = ["worker", "FLOPs/example", "params", "halo in/ex", "halo out/ex", "neighbours"]
    return _table(headers, rows)


def shard_table(layout: ShardLayout) -> str:
    """Values and bytes per parameter-server shard, and the workers routed to each."""
    sizes = layout.shard_sizes()
    mean = sizes.mean() if len(sizes) else 0
    rows = [
        [
            str(s),
            f"{int(n):,}",
            _si(int(n) * BYTES_PER_VALUE, "B"),
            f"{n / mean:.2f}" if mean else "—",
            ",".join(map(str, layout.peers(s))),
        ]
        for s, n in enumerate(sizes)
    ]
    return _table(["shard", "values", "bytes", "vs mean", "workers"], rows)


def sweep_table(sweep) -> str:
    """Predicted step and speedup per worker count, the knee and the peak marked."""
    rows = []
    for n, step, speed in zip(sweep.counts, sweep.step_s, sweep.speedups, strict=True):
        mark = " <- knee" if n == sweep.knee else ""
        mark += " <- fastest" if n == sweep.peak else ""
        rows.append([str(n), f"{step * 1e3:.2f}", f"{speed:.2f}", mark.strip()])
    return _table(["workers", "step ms", "speedup", ""], rows)


def cluster_table(advice) -> str:
    """Every layout of a `ClusterAdvice`, fastest first, the recommendation marked."""
    rows = []
    for i, f in enumerate(advice.layouts):
        epoch = advice.epoch_s(f)
        rows.append(
            [
                str(f.layout),
                f"{f.step_s * 1e3:.2f}",
                f"{f.samples_per_s:,.0f}",
                f"{epoch / 60:.1f} min" if epoch >= 60 else f"{epoch:.1f} s",
                f"{_si(f.link_bytes, 'B')} ({f.link})",
                _si(f.memory_bytes, "B"),
                f"{f.staleness:g}" if f.layout.mode == "downpour" else "-",
                "<- recommended" if i == 0 else ("does not fit" if not f.fits else ""),
            ]
        )
    heads = [
        "layout",
        "step ms",
        "samples/s",
        f"epoch ({advice.examples:,} examples)",
        "busiest link / step",
        "memory / machine",
        "staleness",
        "",
    ]
    return _table(heads, rows)


def cluster_markdown(advice) -> str:
    """report.md of `plan --machines`: what was weighed, the table, the recommendation."""
    return "\n".join(
        [
            f"# {advice.model} on {advice.machines} machines",
            "",
            f"Batch {advice.batch} a replica, Downpour pushing every {advice.n_push} and fetching "
            f"every {advice.n_fetch} steps; predicted with {advice.prediction}.",
            "",
            f"**Recommended**: {advice.why}.",
            "",
            cluster_table(advice),
            "",
            "Layouts: `mode RxN+S` is R replicas of N model workers and S parameter-server shards; "
            "`all-reduce xM` is M replicas of one worker each exchanging gradients by a ring "
            'all-reduce. How each is priced, in words: docs/planning.md, "How to spend M '
            'machines".',
            "",
            "![samples per second by layout](cluster.png)",
            "",
        ]
    )
