"""A plan compiled for one job, once per process: the unit graph, the halo schedule with every
worker's program, and the parameter-server shard layout.

A training job's launcher compiles the plan once (to check and write the run directory and
to read the trained model back from the shards); each of its processes compiles it once and
plays its role with it. Everything below that is passed the compiled plan, not the plan: no
role rebuilds a graph, a schedule or a layout of its own. Each compilation says so in the
process's log (`COMPILED`), which is how a test counts them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from netpart.compile.schedule import SPLIT_MIN_FLOPS, HaloSchedule, plan_schedule
from netpart.compile.shards import ShardLayout
from netpart.models.spec import ModelSpec
from netpart.partition.graph import UnitGraph
from netpart.partition.plans import PartitionPlan

__all__ = ["COMPILED", "CompiledPlan", "compile_plan"]

log = logging.getLogger(__name__)

COMPILED = "compiled the plan"  # the log line each compilation writes


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """What the processes of a job run: the plan's unit graph, its halo schedule (every
    worker's program) and where every parameter lives among `layout.shards` shards."""

    spec: ModelSpec
    plan: PartitionPlan
    graph: UnitGraph
    schedule: HaloSchedule
    layout: ShardLayout


def compile_plan(
    spec: ModelSpec,
    plan: PartitionPlan,
    *,
    shards: int,
    validate: bool = True,
    split_min_flops: float = SPLIT_MIN_FLOPS,
) -> CompiledPlan:
    """Compile `plan` of `spec` for a job of `shards` parameter-server shards. `validate`: check
    the schedule against the plan (the launcher does; its processes need not again);
    `split_min_flops` as `plan_schedule`'s (workers sharing a host split nothing)."""
    graph, schedule = plan_schedule(spec, plan, validate=validate, split_min_flops=split_min_flops)
    layout = ShardLayout.build(graph, plan.node_map, plan.workers, shards)
    log.info("%s: %d workers, %d shards", COMPILED, plan.workers, shards)
    return CompiledPlan(spec, plan, graph, schedule, layout)
