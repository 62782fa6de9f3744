"""Unit graphs, partitioners (METIS with per-layer balance, baselines), plans and their costs."""

from netpart.partition.cost import NetworkModel
from netpart.partition.figures import evaluate
from netpart.partition.graph import Granularity, LayerBlocks, UnitGraph, build_unit_graph
from netpart.partition.methods import METHODS
from netpart.partition.planner import plan
from netpart.partition.plans import LayerFigures, PartitionPlan, PlanMetrics, WorkerFigures
from netpart.partition.shards import ShardLayout

__all__ = [
    "METHODS",
    "Granularity",
    "LayerBlocks",
    "LayerFigures",
    "NetworkModel",
    "PartitionPlan",
    "PlanMetrics",
    "ShardLayout",
    "UnitGraph",
    "WorkerFigures",
    "build_unit_graph",
    "evaluate",
    "plan",
]
