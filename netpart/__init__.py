"""netpart: DistBelief-style model partitioning and distributed training on PyTorch."""

__version__ = "0.1.0"
