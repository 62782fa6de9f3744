"""Compiling a plan: what does each process of a job need to run its part of the model?

A plan turned into the halo schedule (who sends which units to whom, layer by layer), each
worker's program (its validated list of instructions), the gather/scatter indices of its
slices, and the parameter-server shard layout. Pure: no files, sockets or torch.
"""

from netpart.compile.compiled import CompiledPlan, compile_plan
from netpart.compile.schedule import HaloSchedule, plan_schedule
from netpart.compile.shards import ShardLayout

__all__ = ["CompiledPlan", "HaloSchedule", "ShardLayout", "compile_plan", "plan_schedule"]
