"""Measuring a machine and fitting the step-time model to it: `netpart calibrate`.

`measure` runs the calibration (slices, link, steps) through a `Runner` (this machine, or
`hosts`' torchrun job over several), `fitting` turns what it measured into a calibrated
`netpart.partition.cost.NetworkModel` (pure), `speed` is the probe that says how fast the
machine ran meanwhile, and `trace` times every slice of a plan alone (for the scaling
simulation). The profile file a calibration writes is what `--profile FILE` reads.
"""
