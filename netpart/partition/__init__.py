"""Cutting a model: how should a model's units be divided among N workers?

The unit graph (blocks of units, "reads" edges), the partitioners (METIS with one balance
constraint per layer, the layer-aligned plane, tiles, stripes, `auto`), the lower bound on halo
traffic, and the plan with its figures. Pure: no files, sockets or torch.
"""

from netpart.partition.blocks import Granularity, LayerBlocks
from netpart.partition.evaluate import evaluate
from netpart.partition.graph import UnitGraph, build_unit_graph
from netpart.partition.methods import METHODS
from netpart.partition.planner import plan
from netpart.partition.plans import LayerFigures, PartitionPlan, PlanMetrics, WorkerFigures

__all__ = [
    "METHODS",
    "Granularity",
    "LayerBlocks",
    "LayerFigures",
    "PartitionPlan",
    "PlanMetrics",
    "UnitGraph",
    "WorkerFigures",
    "build_unit_graph",
    "evaluate",
    "plan",
]
