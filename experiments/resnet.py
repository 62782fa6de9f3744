"""Issue 79's training figures: a user's narrow ResNet-20 with batch norm
(`tests/models/user_models.py:narrow_resnet20`) trained by `netpart train` over 2 model
workers x 2 replicas, Downpour and synchronous SGD, on procedural images (`--data shapes`,
3x32x32, ten classes), beside one plain PyTorch process training the same module on the
same samples: the same initial weights (netpart's seeded ones, loaded into the module), the
same optimiser (Adagrad, lr 0.01), the two replicas' batches of each step one after the
other (batch 32, twice the steps). Held-out accuracy on the 1,000 held-out images, each
model in eval mode (the batch norms' running statistics); and each run's model.pt loaded
strictly into the user's class, whose eval-mode logits are compared with netpart's
reference module's.

    python experiments/resnet.py                 # 300 steps a replica, ~8 min here
    python experiments/resnet.py --steps 40      # a quick look

Writes experiments/results/resnet.json; the runs' directories go to
experiments/results/runs/ (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.models.user_models

from netpart.files import write_atomic  # noqa: E402
from netpart.models import build_reference, load_spec  # noqa: E402
from netpart.train.config import TrainConfig  # noqa: E402
from netpart.train.run_report import evaluate  # noqa: E402
from tests.models.user_models import narrow_resnet20  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
MODEL = "tests.models.user_models:narrow_resnet20"
INPUT, DATA, BATCH, LR, SEED = "3x32x32", "shapes", 32, 0.01, 0


def netpart_run(mode: str, steps: int) -> dict:
    """`netpart train` of the module, 2 workers x 2 replicas: wall seconds and its summary."""
    run = RESULTS / "runs" / f"resnet-{mode}"
    argv = [sys.executable, "-m", "netpart", "train", "--model", MODEL, "--input", INPUT]
    argv += ["--workers", "2", "--replicas", "2", "--mode", mode, "--data", DATA]
    argv += ["--steps", str(steps), "--batch", str(BATCH), "--lr", str(LR), "--out", str(run)]
    argv += ["--optimizer", "adagrad", "--seed", str(SEED)]
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the module's package
    subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.monotonic() - t0
    summary = json.loads((run / "summary.json").read_text())
    return {"wall_s": wall, "held_out": summary["held_out"], "run": run}


def plain_run(spec, steps: int) -> tuple[dict, dict]:
    """One plain PyTorch process: the same module, weights, optimiser and samples."""
    module = narrow_resnet20()
    names = {**spec.state_names(), **spec.buffer_names()}
    initial = build_reference(spec, SEED).state_dict()
    module.load_state_dict({names[k]: v for k, v in initial.items()}, strict=True)
    data = TrainConfig.of(data=DATA, batch=BATCH, seed=SEED).dataset(spec)
    optimiser = torch.optim.Adagrad(module.parameters(), lr=LR)
    t0 = time.monotonic()
    for t in range(1, steps + 1):
        for replica in range(2):
            x, y = data.batch(replica, 2, t, BATCH, torch.float32)
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(x.reshape(-1, 3, 32, 32)), y)
            loss.backward()
            optimiser.step()
    wall = time.monotonic() - t0
    ours = {v: k for k, v in names.items()}
    state = {ours[k]: v for k, v in module.state_dict().items()}
    return {"wall_s": wall, "held_out": evaluate(spec, state, *data.held_out_set())}, state


def exported_logits_agree(spec, run: Path) -> float:
    """model.pt into the user's class (strict), eval mode: the largest difference of its
    logits from netpart's reference module holding the same state, on held-out images."""
    saved = torch.load(run / "model.pt", weights_only=True)
    module = narrow_resnet20()
    module.load_state_dict(saved, strict=True)
    module.eval()
    names = {**spec.state_names(), **spec.buffer_names()}
    reference = build_reference(spec, SEED)
    reference.load_state_dict({k: saved[names[k]] for k in reference.state_dict()})
    reference.eval()
    x, _ = TrainConfig.of(data=DATA, batch=BATCH, seed=SEED).dataset(spec).held_out_set()
    images = torch.from_numpy(np.ascontiguousarray(x[:256])).float().reshape(-1, 3, 32, 32)
    with torch.no_grad():
        return float((module(images) - reference(images)).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps a replica")
    args = parser.parse_args()
    spec = load_spec(MODEL, input=INPUT)
    out: dict = {"model": f"narrow ResNet-20 ({MODEL})", "steps": args.steps}
    out["params"] = spec.num_params
    for mode in ("sync", "downpour"):
        got = netpart_run(mode, args.steps)
        got["exported_logits_max_diff"] = exported_logits_agree(spec, got.pop("run"))
        out[f"netpart {mode} 2x2"] = got
        print(mode, got, flush=True)
    plain, _ = plain_run(spec, args.steps)
    out["plain torch, 1 process"] = plain
    print("plain", plain, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_atomic(RESULTS / "resnet.json", json.dumps(out, indent=1).encode())


if __name__ == "__main__":
    main()
