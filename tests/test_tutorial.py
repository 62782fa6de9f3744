"""The README's "your own data" quick start, end to end, as a newcomer types it: a spec, a
folder of PNGs, check, plan, train (2 workers x 2 replicas, held-out evaluation, CSV log),
eval, export, and the model loaded in plain PyTorch (no netpart) giving the same predictions.
Then what a newcomer tries next on that run: a resume that would do nothing, one into
another directory, and the progress a log file shows."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from netpart.cli import main
from netpart.data import load_data
from netpart.models import load_spec
from netpart.train.run_report import evaluate
from netpart.train.rundir import run_model

pytestmark = pytest.mark.timeout(300)

SPEC = """\
name = "my-net"
input = { channels = 1, height = 16, width = 16 }
[[layer]]
kind = "local"
channels = 4
kernel = 3
activation = "relu"
[[layer]]
kind = "pool"
kernel = 2
stride = 2
[[layer]]
kind = "dense"
units = 3
activation = "softmax"
"""

PLAIN_TORCH = """\
import json, sys, numpy as np, torch
about = {"netpart.json": ""}
model = torch.export.load(sys.argv[1], extra_files=about).module()
x = torch.from_numpy(np.load(sys.argv[2]))
np.save(sys.argv[3], model(x).detach().numpy())
print(json.dumps(json.loads(about["netpart.json"])["classes"]))
assert "netpart" not in sys.modules
"""


def _images(root):
    """Three classes of 16x16 grey PNGs: a bright bar across, down, or a blob."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(("across", "down", "blob")):
        (root / name).mkdir(parents=True)
        for i in range(24):
            a = rng.uniform(0, 60, (16, 16))
            at = rng.integers(3, 13)
            if label == 0:
                a[at - 1 : at + 2, :] = 255
            elif label == 1:
                a[:, at - 1 : at + 2] = 255
            else:
                a[at - 3 : at + 3, at - 3 : at + 3] = 255
            Image.fromarray(a.astype(np.uint8)).save(root / name / f"{i}.png")


def test_the_quick_start_runs_and_the_model_loads_in_plain_pytorch(tmp_path, capsys):
    (tmp_path / "my-net.toml").write_text(SPEC)
    _images(tmp_path / "images")
    spec, images = str(tmp_path / "my-net.toml"), str(tmp_path / "images")
    run, plans = tmp_path / "run", tmp_path / "plan"

    assert main(["check", "--model", spec, "--workers", "2"]) == 0
    assert main(["plan", "--model", spec, "--workers", "2", "--out", str(plans)]) == 0
    capsys.readouterr()
    train = [
        *"train --model".split(),
        spec,
        *"--workers 2 --replicas 2 --plan".split(),
        str(plans),
        "--data",
        images,
        *"--steps 40 --batch 8 --eval-every 10 --log csv".split(),
        *"--progress-every 0 --out".split(),
        str(run),
    ]
    assert main(train) == 0
    out = capsys.readouterr().out
    assert out.count("run directory") == 1  # the banner, once
    assert "replica steps 40/40: loss" in out  # progress lines off a terminal, per replica
    assert "MB moved" in out
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [10, 20, 30, 40]
    assert (run / "metrics.csv").read_text().startswith("step,replica,time,loss")
    assert len((run / "eval.csv").read_text().splitlines()) == 5

    assert main(["eval", str(run)]) == 0
    assert "held-out" in capsys.readouterr().out
    assert main(["export", str(run)]) == 0
    capsys.readouterr()

    # the held-out images as pixels in [0, 1], the model's logits from plain PyTorch
    data = load_data(images, load_spec(spec), 0)
    x, y = data.held_out_set()
    mean, std = data.standardised
    pixels = (x * std + mean).reshape(len(x), 1, 16, 16).astype(np.float32)
    np.save(tmp_path / "x.npy", pixels)
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN_TORCH,
            str(run / "model.pt2"),
            str(tmp_path / "x.npy"),
            str(tmp_path / "logits.npy"),
        ],
        check=True,
        timeout=120,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    # the run records what a user needs to use it (issue 80, item 4): the class names in
    # label order, and the standardisation, also inside the exported program
    assert json.loads(plain.stdout) == ["across", "blob", "down"]  # the folders, sorted
    fed = json.loads((run / "data.json").read_text())
    assert fed["classes"] == ["across", "blob", "down"]
    assert fed["standardised"] == pytest.approx({"mean": mean, "std": std})
    logits = torch.from_numpy(np.load(tmp_path / "logits.npy"))
    job, state = run_model(run, from_shards=True)
    from netpart.models.reference import build_reference

    reference = build_reference(job.spec)
    reference.load_state_dict({k: v.float() for k, v in state.items()})
    want = reference(torch.from_numpy(x))
    assert torch.allclose(logits, want, atol=1e-4)
    ours = evaluate(job.spec, state, x, y)
    accuracy = float((logits.argmax(1).numpy() == y).mean())
    assert accuracy == pytest.approx(ours["accuracy"])

    # a resume that would do nothing, or would train elsewhere, is one line; nothing changes
    manifest = (run / "train.json").read_bytes()
    assert main(["train", "--resume", str(run), "--steps", "40", "--lr", "0.02"]) == 2
    assert "at step 40 already" in capsys.readouterr().err
    other = tmp_path / "elsewhere"
    assert main(["train", "--resume", str(run), "--steps", "60", "--out", str(other)]) == 2
    assert "continues in its own run directory" in capsys.readouterr().err
    assert (run / "train.json").read_bytes() == manifest and not other.exists()
