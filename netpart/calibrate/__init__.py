"""Measuring a machine: what are this machine's figures, written as a profile the cost model
reads? (`netpart calibrate`)

`measure` runs the calibration (slices, link, steps) through a `Runner` (this machine, or
`hosts`' torchrun job over several), `fitting` turns what it measured into a calibrated
`netpart.cost.machine.Machine` (pure), `speed` is the probe that says how fast the
machine ran meanwhile, and `trace` times every slice of a plan alone (for the scaling
simulation). The profile file a calibration writes is what `--profile FILE` reads.
"""

__all__ = ["CALIBRATION_MODELS", "CHECK_MODEL", "SLICE_MODELS"]

CHECK_MODEL = "speech"  # stepped only to check the fitted model (its slices are timed)
CALIBRATION_MODELS = ("tiny-mlp", "digits-mlp", "tiny-local", "bench-local", "bench-local-wide")
# Models whose slices only are timed: they carry the kinds' tables to the sizes larger models
# use (large dense slices run at a higher FLOP rate than the MLPs' small ones, which a table
# would extrapolate from otherwise), and to the kinds the calibration models lack (conv, both
# torch's convolution and gathered patches).
SLICE_MODELS = ("speech", "cifar-cnn")
