"""`lone_step`: a one-worker replica's training step, as measurements run it where a training
step would be, runs back to back in a process of its own over a one-rank gloo group."""

from __future__ import annotations

import json
import subprocess
import sys

ROLE = """
import json, sys
import torch.distributed as dist
from netpart.models import load_spec
from netpart.partition.planner import plan
from netpart.ps.timed_exchange import timed_calls
from netpart.runtime.check import lone_step
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
spec = load_spec("tiny-mlp")
step = lone_step(spec, plan(spec, 1, seed=0, batch=32), dist.new_group([0]), 0)
print(json.dumps(timed_calls(step, 2)))
dist.destroy_process_group()
"""


def test_lone_step_runs_back_to_back(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", ROLE, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-600:]
    seconds, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    assert seconds > 0 and cpu > 0
