"""Held-out evaluation during training (`--eval-every K`): replica 0's workers run the
forward pass alone (`ModelWorker.evaluate`, the same messages on every worker) over a fixed
slice of the held-out examples every K steps and at the last step; worker 0 appends one line
per evaluation to `eval.jsonl` in the run directory:

    {"step": 200, "time": 1764150000.1, "replica": 0, "examples": 512, "loss": 0.21,
     "accuracy": 0.94}

(`accuracy` only for softmax models). The examples are never trained on.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from netpart.data import Dataset
from netpart.files import open_append
from netpart.models.spec import ModelSpec
from netpart.runtime.transport import Transport
from netpart.runtime.worker import ModelWorker

__all__ = ["EVAL_EXAMPLES", "HeldOut"]

EVAL_EXAMPLES = 512  # held-out examples per evaluation (fewer where fewer are held out)


class HeldOut:
    """The held-out batches one worker evaluates, and (worker 0) the file it reports to."""

    def __init__(
        self, spec: ModelSpec, data: Dataset, batch: int, dtype: torch.dtype, path: Path | None
    ) -> None:
        x, y = data.held_out_set()
        count = min(len(x), EVAL_EXAMPLES)
        size = min(batch, count)  # the training batch: its buffers are allocated already
        count -= count % size
        labels = torch.long if spec.loss == "cross_entropy" else dtype
        self.batches = [
            (
                torch.from_numpy(np.ascontiguousarray(x[lo : lo + size])).to(dtype),
                torch.from_numpy(np.ascontiguousarray(y[lo : lo + size])).to(labels),
            )
            for lo in range(0, count, size)
        ]
        self.examples, self.path = count, path

    def __call__(self, step: int, model: ModelWorker, transport: Transport) -> dict:
        """Evaluate at `step`; worker 0 appends the line. Returns it."""
        loss = correct = 0.0
        for x, y in self.batches:
            batch_loss, accuracy = model.evaluate(x, y, transport)
            loss += batch_loss * len(x)
            correct += (accuracy or 0.0) * len(x)
        line = {
            "step": step,
            "time": time.time(),
            "replica": 0,
            "examples": self.examples,
            "loss": loss / self.examples,
        }
        if model.spec.loss == "cross_entropy":
            line["accuracy"] = correct / self.examples
        if self.path is not None:
            fd = open_append(self.path, lines=True)
            try:
                os.write(fd, (json.dumps(line) + "\n").encode())
            finally:
                os.close(fd)
        return line
