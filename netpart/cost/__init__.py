"""The cost model: how long will a step, a halo exchange or a parameter-server exchange take
on a given machine, and how much memory does training hold?

The machine's figures (`Machine`: rates per layer kind and slice size, per-message and
per-phase costs, link tables, the parameter server's exchange tables), read from `--net`,
`--machine` or `--profile`; the step-time model; the split-layer overlap rule. Pure.
"""

from netpart.cost.machine import Machine

__all__ = ["Machine"]
