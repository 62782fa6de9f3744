"""Metrics in the formats other tools read (`--log csv,tensorboard`), besides the run's own
`metrics_replica<r>.jsonl` and `eval.jsonl`:

  csv          metrics.csv (one row per replica step: CSV_FIELDS) and eval.csv (one row per
               held-out evaluation: EVAL_FIELDS), appended as lines arrive
  tensorboard  event files in tensorboard/ (`tensorboard --logdir RUN/tensorboard`):
               train/loss, train/accuracy, train/samples_per_s per replica; held_out/loss,
               held_out/accuracy; x: the replica's step (needs the `tensorboard` package)

On one machine the launcher writes them while the job runs, from the lines the processes
append; under torchrun the first shard writes them from the files once the job is done.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

from netpart.errors import TrainError
from netpart.files import open_append

__all__ = ["CSV_FIELDS", "EVAL_FIELDS", "LOGGERS", "MetricLoggers", "check_loggers"]

LOGGERS = ("csv", "tensorboard")
CSV_FIELDS = (
    "step",
    "replica",
    "time",
    "loss",
    "accuracy",
    "staleness",
    "samples",
    "step_s",
    "compute_s",
    "halo_s",
    "ps_s",
    "data_s",
    "cpu_s",
    "halo_bytes",
    "ps_bytes",
)
EVAL_FIELDS = ("step", "replica", "time", "examples", "loss", "accuracy")


def check_loggers(names: tuple[str, ...]) -> None:
    """TrainError (one line) for an unknown logger or a missing package."""
    for name in names:
        if name not in LOGGERS:
            raise TrainError(f"--log {name}: choose from {', '.join(LOGGERS)} (comma-separated)")
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise TrainError(
            "--log tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or log csv only)"
        )


class MetricLoggers:
    """The loggers of `names`, writing into the run directory `run`."""

    def __init__(self, run: Path, names: tuple[str, ...]) -> None:
        check_loggers(names)
        self.run, self.names = run, names
        self._writer = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run / "tensorboard"))

    def train_line(self, line: dict) -> None:
        """A replica step's metrics line (`metrics_replica<r>.jsonl`)."""
        if "csv" in self.names:
            self._append("metrics.csv", CSV_FIELDS, line)
        if self._writer is not None:
            step, r = int(line["step"]), int(line.get("replica", 0))
            self._writer.add_scalar(f"train/loss/replica{r}", line["loss"], step)
            if line.get("accuracy") is not None:
                self._writer.add_scalar(f"train/accuracy/replica{r}", line["accuracy"], step)
            if line.get("step_s"):
                rate = line.get("samples", 0) / line["step_s"]
                self._writer.add_scalar(f"train/samples_per_s/replica{r}", rate, step)

    def eval_line(self, line: dict) -> None:
        """A held-out evaluation's line (`eval.jsonl`)."""
        if "csv" in self.names:
            self._append("eval.csv", EVAL_FIELDS, line)
        if self._writer is not None:
            self._writer.add_scalar("held_out/loss", line["loss"], int(line["step"]))
            if "accuracy" in line:
                self._writer.add_scalar("held_out/accuracy", line["accuracy"], int(line["step"]))

    def replay(self) -> None:
        """Write every line the run's files hold (under torchrun, once the job is done)."""
        for path in sorted(self.run.glob("metrics_replica*.jsonl")):
            for raw in path.read_text().splitlines():
                if raw.strip():
                    self.train_line(json.loads(raw))
        path = self.run / "eval.jsonl"
        if path.exists():
            for raw in path.read_text().splitlines():
                if raw.strip():
                    self.eval_line(json.loads(raw))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _append(self, name: str, fields: tuple[str, ...], line: dict) -> None:
        path = self.run / name
        new = not path.exists()
        with os.fdopen(open_append(path, lines=True), "a", newline="") as f:
            out = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                out.writeheader()
            out.writerow({k: line.get(k) for k in fields})
