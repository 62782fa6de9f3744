"""How to spend M machines: R replicas x N model workers + S parameter-server shards (Downpour
or synchronous SGD), or M data-parallel replicas that all-reduce their gradients (DDP's way),
each layout predicted on one machine model, and the fastest that fits recommended.

docs/planning.md ("How to spend M machines") says in words how a layout is priced. In short,
per replica step of `batch` examples (every machine alike, its link full duplex;
`Machine.phase_s` prices a transfer):

- the model-parallel step is the plan's predicted step for N workers;
- the parameter-server exchange is read off the profile's measured tables (`PsExchange`,
  `_measured`) where calibration ran it on machines of their own, else priced off the link
  (`_linked`): Downpour's push and fetch beside the next step, sync's after it;
- a worker's training loop costs `loop_cpu_s` a step beside them;
- on a share of a core (a cpu quota) a step is at least its CPU over the share plus the
  exchange's busy time, and a ring phase at least a quota period;
- all-reduce: each replica's step alone (DDP's replica step where calibration timed it),
  then the ring (`Machine.allreduce_s`, the one price of an all-reduce), then every
  replica's update (`UPDATE_S_PER_VALUE` a value);
- memory per machine is `netpart.cost.memory`'s estimate, the one `netpart train` checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from netpart.compile.shards import ShardLayout
from netpart.cost.exchange import PsExchange
from netpart.cost.machine import Machine
from netpart.cost.memory import BASE_BYTES, activation_values, shard_bytes, worker_bytes
from netpart.errors import PlanError
from netpart.models.spec import BYTES_PER_VALUE, ModelSpec
from netpart.partition.blocks import Granularity
from netpart.partition.graph import build_unit_graph, graph_size
from netpart.partition.planner import plan

__all__ = [
    "CLUSTER_SCHEMA",
    "LOOP_CPU_S",
    "LOOP_DENSE_SLICES",
    "UPDATE_S_PER_VALUE",
    "ClusterAdvice",
    "Layout",
    "LayoutFigures",
    "advise",
    "advise_for_machines",
    "loop_cpu_s",
    "trainable",
]

CLUSTER_SCHEMA = 1
# A shard's Adagrad update of one value, on one core (torch's fused kernel). A machine
# description does not state it. Where it was measured: docs/measurements.md.
UPDATE_S_PER_VALUE = 0.8e-9
# A worker's training loop beyond its step and its exchange, CPU seconds a step, for a
# machine without dense figures (docs/measurements.md).
LOOP_CPU_S = 0.4e-3
# That loop in the smallest dense slices of the machine it was measured on: the loop's CPU
# follows the machine's speed, where a constant would price a slower host's loop at a
# faster one's.
LOOP_DENSE_SLICES = 1.7
# Layouts predicted this close are a tie: on a testbed the recommended layout measured within
# 10% of the best, not closer (docs/measurements.md).
TIE = 0.05


def loop_cpu_s(network: Machine) -> float:
    """A worker's training loop's own CPU a step on `network`'s machines (module docstring)."""
    dense = network.kinds.get("dense")
    if dense is None:
        return LOOP_CPU_S
    return LOOP_DENSE_SLICES * dense.floor_s


@dataclass(frozen=True)
class Layout:
    """R replicas of N workers and S shards (all-reduce: S = 0, N = 1)."""

    mode: str
    replicas: int
    workers: int
    shards: int

    @property
    def machines(self) -> int:
        return self.replicas * self.workers + self.shards

    def __str__(self) -> str:
        if self.mode == "allreduce":
            return f"all-reduce x{self.replicas}"
        return f"{self.mode} {self.replicas}x{self.workers}+{self.shards}"


@dataclass(frozen=True)
class LayoutFigures:
    """A layout's predicted figures (module docstring)."""

    layout: Layout
    step_s: float  # a replica's effective step
    samples_per_s: float
    link_bytes: float  # per replica step, one direction, on the busiest link
    link: str  # which link that is
    memory_bytes: float  # on the busiest machine
    staleness: float  # Downpour; 0 otherwise
    fits: bool  # within the stated memory per machine (always, if none is stated)

    def to_dict(self) -> dict:
        return {**asdict(self), "layout": asdict(self.layout), "name": str(self.layout)}

    @classmethod
    def from_dict(cls, d: dict) -> LayoutFigures:
        d = {k: v for k, v in d.items() if k != "name"}
        return cls(**{**d, "layout": Layout(**d["layout"])})


@dataclass(frozen=True)
class ClusterAdvice:
    """Every layout of `machines` predicted, and the fastest that fits."""

    model: str
    machines: int
    batch: int
    examples: int  # per epoch, for the time per epoch
    n_push: int
    n_fetch: int
    prediction: str  # the machine model's description
    layouts: tuple[LayoutFigures, ...]  # fastest first
    why: str

    @property
    def best(self) -> LayoutFigures:
        return self.layouts[0]

    def epoch_s(self, figures: LayoutFigures) -> float:
        return self.examples / figures.samples_per_s

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layouts"] = [f.to_dict() for f in self.layouts]
        return {"schema_version": CLUSTER_SCHEMA, **out}

    @classmethod
    def from_dict(cls, d: dict) -> ClusterAdvice:
        d = {k: v for k, v in d.items() if k != "schema_version"}
        layouts = tuple(LayoutFigures.from_dict(f) for f in d.pop("layouts"))
        return cls(**d, layouts=layouts)


def advise_for_machines(
    spec: ModelSpec,
    machines: int,
    network: Machine,
    *,
    memory_per_machine: float = 0.0,
    blocks_per_worker: int | None = None,
    **given,
) -> ClusterAdvice:
    """`advise` as `plan --machines` and `train --machines` ask it: no more workers a replica
    than the model's widest layer has blocks at that granularity (`blocks_per_worker`, the
    plan's default where None), the machines' stated memory; `given`: batch, n_push, n_fetch,
    examples."""
    granularity = (
        Granularity.for_workers(machines)
        if blocks_per_worker is None
        else Granularity.for_workers(machines, blocks_per_worker)
    )
    widest = graph_size(spec, granularity).widest
    return advise(
        spec,
        machines,
        network,
        memory_per_machine=memory_per_machine,
        max_workers=widest,
        **given,
    )


def advise(
    spec: ModelSpec,
    machines: int,
    network: Machine,
    *,
    batch: int = 32,
    examples: int = 60000,
    n_push: int = 1,
    n_fetch: int = 1,
    memory_per_machine: float = 0.0,
    max_workers: int | None = None,
) -> ClusterAdvice:
    """Every layout of at most `machines` machines (module docstring), fastest first; the
    recommendation is the fastest that fits `memory_per_machine` (0: not stated)."""
    if machines < 1:
        raise PlanError(f"--machines {machines}: give at least 1")
    rows: list[LayoutFigures] = []
    one = _mp_step(spec, 1, batch, network)
    replica_values = one.layout.total
    rows.append(_allreduce(spec, machines, one.step_s, replica_values, network, batch))
    n = 1
    while n < machines and (max_workers is None or n <= max_workers):
        mp = one if n == 1 else _mp_step(spec, n, batch, network)
        for r in range(1, (machines - 1) // n + 1):
            shards = machines - r * n
            lay = ShardLayout.build(mp.graph, mp.node_map, n, shards)
            for mode in ("downpour", "sync"):
                push, fetch = (n_push, n_fetch) if mode == "downpour" else (1, 1)
                rows.append(
                    _ps(spec, Layout(mode, r, n, shards), mp, lay, network, batch, (push, fetch))
                )
        n *= 2
    rows = [_fits(f, memory_per_machine) for f in rows]
    rows.sort(key=lambda f: (not f.fits, -f.samples_per_s, f.layout.machines, str(f.layout)))
    if not rows[0].fits:
        raise PlanError(
            f"no layout of {machines} machines fits {memory_per_machine / 2**30:.3g} GiB per "
            f"machine; the smallest needs {min(f.memory_bytes for f in rows) / 2**30:.3g} GiB"
        )
    return ClusterAdvice(
        model=spec.name,
        machines=machines,
        batch=batch,
        examples=examples,
        n_push=n_push,
        n_fetch=n_fetch,
        prediction=network.describe(),
        layouts=tuple(rows),
        why=_why(rows),
    )


@dataclass(frozen=True)
class _ModelParallel:
    step_s: float
    cpu_s: float  # the step less its halo exchange: what keeps a worker's core busy
    graph: object
    node_map: np.ndarray
    layout: ShardLayout  # one shard: the replica's values, per worker
    activations: float  # values per example a replica holds at its peak (`cost.memory`)


def _mp_step(spec: ModelSpec, n: int, batch: int, network: Machine) -> _ModelParallel:
    p = plan(spec, n, seed=0, batch=batch, network=network)
    graph = build_unit_graph(spec, p.granularity or Granularity.for_workers(n))
    acts = float(activation_values(spec))
    one_shard = ShardLayout.build(graph, p.node_map, n, 1)
    step = p.metrics.predicted_step_s
    cpu = max(0.0, step - p.metrics.exchange_s)
    return _ModelParallel(step, cpu, graph, p.node_map, one_shard, acts)


def _ps(
    spec,
    layout: Layout,
    mp: _ModelParallel,
    shards: ShardLayout,
    network,
    batch: int,
    every: tuple[int, int],
) -> LayoutFigures:
    """A parameter-server layout's figures (module docstring)."""
    n_push, n_fetch = every
    r, n = layout.replicas, layout.workers
    sizes = np.array([shards.worker_size(w) for w in range(n)], dtype=np.float64)
    nbytes = BYTES_PER_VALUE * sizes
    held = BYTES_PER_VALUE * shards.shard_sizes().astype(np.float64)
    price = _linked if network.ps is None else _measured
    step = price(network, layout, mp, shards, (nbytes, held), every)
    worker = worker_bytes(
        params=sizes.max(), activations=mp.activations / n, batch=batch, value_bytes=BYTES_PER_VALUE
    )
    shard = shard_bytes(
        values=held.max() / BYTES_PER_VALUE, optimizer="adagrad", value_bytes=BYTES_PER_VALUE
    )
    memory = BASE_BYTES + max(worker, shard)
    busiest = int(np.argmax(held))
    link_bytes = float(r * held[busiest] / min(n_push, n_fetch))
    staleness = 0.0 if layout.mode == "sync" else (r - 1) * max(n_push, n_fetch) / n_push
    return LayoutFigures(
        layout, step, r * batch / step, link_bytes, f"shard {busiest}", memory, staleness, True
    )


def _linked(
    network: Machine,
    layout: Layout,
    mp: _ModelParallel,
    shards: ShardLayout,
    bytes_: tuple[np.ndarray, np.ndarray],
    every: tuple[int, int],
) -> float:
    """A replica's step priced off the link tables (`bytes_`: each worker's, each shard's)."""
    mp_s = mp.step_s
    (n_push, n_fetch), (nbytes, held), r = every, bytes_, layout.replicas
    peers = np.array([len(shards.routes(w)) for w in range(layout.workers)])
    transfer = float(network.phase_s(nbytes, peers).max())  # a worker's push, or its fetch
    worker_push, worker_fetch = transfer / n_push, transfer / n_fetch
    talkers = np.array([len(shards.peers(s)) * r for s in range(layout.shards)])
    served = network.phase_s(r * held, talkers)  # each shard's R pushes in, or fetches out
    shard_in, shard_out = served / n_push, served / n_fetch
    update = r * shards.shard_sizes() * UPDATE_S_PER_VALUE / n_push
    if layout.mode == "sync":  # pushes in (each worker's and the shard's links at once),
        # the update, fetches out
        into = np.maximum(shard_in, worker_push) + update + np.maximum(shard_out, worker_fetch)
        return mp_s + loop_cpu_s(network) + float(into.max())
    # the courier carries a step's push and fetch at once (both ways, as `phase_s` prices
    # them) beside the next step
    own = max(mp_s + loop_cpu_s(network), worker_push, worker_fetch)
    return max(own, float(np.maximum(np.maximum(shard_in, shard_out), update).max()))


def _measured(
    network: Machine,
    layout: Layout,
    mp: _ModelParallel,
    shards: ShardLayout,
    bytes_: tuple[np.ndarray, np.ndarray],
    every: tuple[int, int],
) -> float:
    """A replica's step priced off the parameter server's measured exchange (`_exchange`),
    corrected where calibration timed its exchanges after a stand-in step (`ps.after`): the
    stand-in priced the same way on this layout, against what it measured, that miss carried
    over in proportion to the model's step CPU (up to the stand-in's) and to its exchanges
    a step."""
    ps: PsExchange = network.ps
    nbytes, held = bytes_
    peers = [max(1, len(shards.peers(s))) for s in range(layout.shards)]
    clients = [layout.replicas * p for p in peers]
    routes = [shards.routes(w) for w in range(layout.workers)]
    talks = [
        (float(b), len(r), max((clients[s] for s in r), default=1))
        for b, r in zip(nbytes, routes, strict=True)
    ]
    served = max(ps.exchange_s(layout.mode, c, k, b) for b, k, c in talks)
    for s in range(layout.shards):  # a few shards
        served = max(served, ps.seconds_s(layout.mode, clients[s], float(held[s]) / peers[s]))
    busy = max(ps.busy_s(layout.mode, b, shards=k, clients=c) for b, k, c in talks)
    per = 0.5 * (1 / every[0] + 1 / every[1])
    loop = loop_cpu_s(network)
    price = _exchange(ps, layout.mode, (mp.step_s, mp.cpu_s), (served, busy), per, loop=loop)
    after = [ps.after_s(layout.mode, c, k, b) for b, k, c in talks]
    if None in after:
        return price
    wall = ps.stand_in_s / ps.share  # the stand-in on a measured machine: CPU at its share
    missed = max(after) - _exchange(ps, layout.mode, (wall, wall), (served, busy), 1.0, loop=loop)
    return price + per * min(1.0, ps.step_cpu_s(mp.cpu_s) / ps.stand_in_s) * missed


def _exchange(
    ps: PsExchange,
    mode: str,
    step: tuple[float, float],
    measured: tuple[float, float],
    per: float,
    *,
    loop: float,
) -> float:
    """A step of `step` (seconds, and of them CPU on a whole core) with `per` exchanges a
    step of `measured` (seconds: the longer of the worker's and the shards'; and the time
    it keeps the worker's machine busy). Sync adds it to the step (its measured time holds
    the client's CPU); Downpour runs it beside the step where the worker's machine has
    room for the CPU it costs (its busy time). On a share of a core, either is at least
    the step's CPU over the share plus that busy time; either with the loop's own CPU
    (`loop`, CPU seconds a step)."""
    (step_s, cpu_s), (seconds, busy) = step, measured
    busy, exchange = per * busy, per * seconds
    # the machine's CPU in a step, over its share: the step's (alone, a short one ran within
    # the quota at a whole core's speed) and the exchange's
    held_to = max(step_s, ps.step_cpu_s(cpu_s) / ps.share) + busy + loop / ps.share
    if mode == "sync":  # the exchange's time holds its CPU; a quota may hold all
        return max(step_s + loop + exchange, held_to if ps.share < 1 else 0.0)
    return max(held_to, exchange)


def _allreduce(spec, machines: int, step_one: float, values: int, network, batch: int):
    """All-reduce with `machines` replicas of one worker each."""
    step = _replica_s(spec, step_one, values, network, batch) + network.allreduce_s(
        values, machines
    )
    link = 2 * (machines - 1) / machines * BYTES_PER_VALUE * values if machines > 1 else 0.0
    acts = activation_values(spec)
    memory = BASE_BYTES + worker_bytes(
        params=values, activations=acts, batch=batch, value_bytes=BYTES_PER_VALUE
    )
    return LayoutFigures(
        Layout("allreduce", machines, 1, 0),
        step,
        machines * batch / step,
        float(link),
        "every machine (ring)",
        float(memory),
        0.0,
        True,
    )


def _replica_s(spec, step_one: float, values: int, network, batch: int) -> float:
    """A replica's step without its ring: netpart's one-worker step and a whole model's
    update; where calibration timed DDP's replica step of this model (`PsExchange.replica`),
    that, at another batch carried over as its ratio to this price at the batch it was
    timed at."""
    ps: PsExchange | None = network.ps
    share = ps.share if ps is not None else 1.0
    update = values * UPDATE_S_PER_VALUE / share
    timed = ps.replica_s(spec.name) if ps is not None else None
    if timed is None:
        return step_one + update
    if ps.replica_batch == batch:
        return timed
    at = plan(spec, 1, seed=0, batch=ps.replica_batch, network=network).metrics.predicted_step_s
    return (step_one + update) * timed / (at + update)


def _fits(f: LayoutFigures, memory: float) -> LayoutFigures:
    if memory <= 0 or f.memory_bytes <= memory:
        return f
    return LayoutFigures(**{**asdict(f), "layout": f.layout, "fits": False})


def trainable(advice: ClusterAdvice) -> LayoutFigures:
    """The fastest layout of `advice` that fits and `netpart train` runs: a parameter-server
    layout (all-reduce is DistributedDataParallel's). PlanError if there is none."""
    for f in advice.layouts:
        if f.fits and f.layout.mode != "allreduce":
            return f
    raise PlanError(
        f"--machines {advice.machines}: no parameter-server layout fits (one needs at least 2 "
        "machines: a replica's worker and a shard)"
    )


def _why(rows: list[LayoutFigures]) -> str:
    best = rows[0]
    others = [f for f in rows[1:] if f.fits]
    if not others:
        return f"{best.layout} is the only layout that fits"
    nxt = others[0]
    ratio = best.samples_per_s / nxt.samples_per_s
    if ratio < 1 + TIE:
        return (
            f"{best.layout} and {nxt.layout} are a tie: predicted within {TIE:.0%} of each "
            f"other ({ratio:.3f}x), closer than the model can tell apart; {best.layout} is "
            f"first for its faster prediction ({best.samples_per_s:,.0f} samples/s); its "
            f"busiest link carries {best.link_bytes / 1e6:.3g} MB a step, "
            f"{nxt.layout}'s {nxt.link_bytes / 1e6:.3g} MB"
        )
    return (
        f"{best.layout}: {best.samples_per_s:,.0f} samples/s predicted, "
        f"{ratio:.2f}x the next ({nxt.layout}); its busiest "
        f"link ({best.link}) carries {best.link_bytes / 1e6:.3g} MB a step"
    )
