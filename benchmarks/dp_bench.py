"""Data-parallel benchmark: the same job on five systems, side by side, alternated in rounds.

The job: an MLP 64-256-256-10 (relu, softmax; netpart's `digits-mlp`) on scikit-learn's bundled
digits (netpart's split: 1,438 to train on, 359 held out, /16 then standardised), batch 32 per
replica, SGD lr 0.05, 300 steps per replica, one thread per process:

- `plain`: one plain torch process (R=1);
- `pytorch-distbelief` 0.1.0 (PyPI), Downpour with n_push = n_pull = 1: a server process and R
  workers (installed by this script into its own environment, never a netpart dependency).
  It drops the Work of every `dist.isend`, and with this torch's gloo such a message is never
  delivered: its server applies no push and its workers train alone. `-delivered` is the same
  code with its `send_message` patched to keep each Work until it completed (its messages
  then arrive: the server applies pushes and answers requests);
- `ddp`: torch DistributedDataParallel over gloo, R processes;
- `netpart-downpour` and `netpart-sync`: `netpart train --workers 1 --replicas R --ps-shards 1`.

Per run: samples/s over the steps (all replicas; from each system's own timing of its step
loop), wall time of the whole command including start-up, and held-out accuracy on the same
359 images. Every peer reads the same arrays. Round k seeds every system with k (weights and
batch order): one image is 0.28% of the held-out set, so accuracies are compared as medians
over seeds, not as one run's. pytorch-distbelief's workers never wait for its server: the
script also records how many of their pushes the server had applied when the first worker
left (its exit ends the server; netpart's shards apply every push before a run ends).

    python benchmarks/dp_bench.py --out benchmarks/results/dp_bench.json
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import parser, write_results

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / ".peers-venv"  # gitignored: the peers' own environment
STEPS, BATCH, LR = 300, 32, 0.05
PEER_TIMEOUT = 60.0  # seconds for one peer run (its steps take a few)

COMMON = r"""
import json, os, sys, time
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
data = np.load(sys.argv[1])
steps, batch, lr, seed = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
X, Y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
XT, YT = torch.from_numpy(data["x_test"]).float(), torch.from_numpy(data["y_test"]).long()
def mlp():
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))
def batches(replica, replicas):
    own = np.arange(replica, len(X), replicas)
    rng = np.random.default_rng([seed, replica])
    epochs = steps * batch // len(own) + 2
    order = np.concatenate([own[rng.permutation(len(own))] for _ in range(epochs)])
    for s in range(steps):
        idx = torch.from_numpy(order[s * batch:(s + 1) * batch])
        yield X[idx], Y[idx]
def accuracy(model):
    with torch.no_grad():
        return float((model(XT).argmax(1) == YT).double().mean())
"""

PLAIN = (
    COMMON
    + r"""
model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=lr)
t0 = time.perf_counter()
for x, y in batches(0, 1):
    opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
t1 = time.perf_counter()
print(json.dumps({"samples": steps * batch, "seconds": t1 - t0, "accuracy": accuracy(model)}))
"""
)

PDB = (
    COMMON
    + r"""
import torch.distributed as dist
rank, world, out = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
dist.init_process_group("gloo", init_method="file://" + sys.argv[9], rank=rank, world_size=world)
model = mlp()
if sys.argv[10] == "delivered":  # keep each isend's Work until it completed: else never sent
    import distbelief.optim.downpour_sgd as D, distbelief.server as S
    import distbelief.utils.messaging as M
    pending = []
    def send_message(message_code, payload, dst=0):
        m = torch.cat((torch.Tensor([dist.get_rank(), message_code.value]), payload))
        pending[:] = [w for w in pending if not w.is_completed()] + [dist.isend(m, dst=dst)]
    M.send_message = D.send_message = S.send_message = send_message
if rank == 0:
    from distbelief.server import ParameterServer
    applied = [0]
    class Counting(ParameterServer):  # counts the gradient updates it applied
        def receive(self, sender, message_code, parameter):
            super().receive(sender, message_code, parameter)
            applied[0] += message_code.value == 1  # MessageCode.GradientUpdate
    try:
        Counting(model).run()  # serves until the driver stops it, or a worker left
    finally:  # then the traceback of the closed connection, and the driver stops it
        with open(out + ".applied", "w") as f:
            f.write(str(applied[0]))
from distbelief.optim import DownpourSGD
opt = DownpourSGD(model.parameters(), lr=lr, n_push=1, n_pull=1, model=model)
t0 = time.perf_counter()
for x, y in batches(rank - 1, world - 1):
    opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
t1 = time.perf_counter()
json.dump({"samples": steps * batch, "start": t0, "end": t1, "accuracy": accuracy(model)},
          open(f"{out}.{rank}", "w"))
sys.stdout.flush(); os._exit(0)  # its listener thread blocks in recv for ever
"""
)

DDP = (
    COMMON
    + r"""
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
rank, world, out = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
dist.init_process_group("gloo", init_method="file://" + sys.argv[9], rank=rank, world_size=world)
model = DistributedDataParallel(mlp()); opt = torch.optim.SGD(model.parameters(), lr=lr)
dist.barrier()
t0 = time.perf_counter()
for x, y in batches(rank, world):
    opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
t1 = time.perf_counter()
json.dump({"samples": steps * batch, "start": t0, "end": t1,
           "accuracy": accuracy(model.module)}, open(f"{out}.{rank}", "w"))
dist.destroy_process_group()
"""
)


def ensure_peers() -> Path:
    """The peers' environment (torch + pytorch-distbelief), made once."""
    python = PEERS / "bin" / "python"
    if not python.exists():
        print(f"making {PEERS} (torch==2.13.0, pytorch-distbelief==0.1.0)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0", "pytorch-distbelief==0.1.0", "numpy"], check=True)
    return python


def prepare_data(path: Path) -> None:
    """netpart's digits arrays for the MLP (the same split every system trains and tests on)."""
    from netpart.data import load_data
    from netpart.models import load_spec

    data = load_data("digits", load_spec("digits-mlp"))
    x_test, y_test = data.held_out
    np.savez(path, x=data.x, y=data.y, x_test=x_test, y_test=y_test)


def _processes(
    python: Path, script: str, args: list[str], world: int, tmp: Path, variant: str = ""
) -> list[dict]:
    """`world` ranks of `script`; the per-rank results they wrote (None if a rank failed or
    did not finish within PEER_TIMEOUT seconds: pytorch-distbelief sometimes hangs)."""
    out, store = tmp / f"result{time.monotonic_ns()}", tmp / f"store{time.monotonic_ns()}"
    procs = [
        subprocess.Popen(
            [
                str(python),
                "-c",
                script,
                *args,
                str(rank),
                str(world),
                str(out),
                str(store),
                variant,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(world)
    ]
    try:
        deadline = time.monotonic() + PEER_TIMEOUT
        waiting = procs[1:] if script is PDB else procs  # pdb's server serves for ever
        for p in waiting:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        if script is PDB:  # its count is written once a worker's exit closed its connection
            deadline = time.monotonic() + 2.0
            while not Path(f"{out}.applied").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    ranks = range(1, world) if script is PDB else range(world)
    try:
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in ranks]
    except (OSError, json.JSONDecodeError):
        return None
    if script is PDB:  # the gradient updates its server applied before a worker left
        with contextlib.suppress(OSError, ValueError):
            got[0]["applied"] = int(Path(f"{out}.applied").read_text())
    return got


def run_peer(system: str, replicas: int, python: Path, data: Path, tmp: Path, seed: int) -> dict:
    args = [str(data), str(STEPS), str(BATCH), str(LR), str(seed)]
    t0 = time.perf_counter()
    if system == "plain":
        res = json.loads(
            subprocess.run(
                [str(python), "-c", PLAIN, *args], capture_output=True, text=True, check=True
            ).stdout
        )
        wall = time.perf_counter() - t0
        return {
            "samples_s": res["samples"] / res["seconds"],
            "accuracy": res["accuracy"],
            "wall_s": wall,
        }
    pdb = system.startswith("pytorch-distbelief")
    script, world = (PDB, replicas + 1) if pdb else (DDP, replicas)
    variant = "delivered" if system.endswith("-delivered") else "as-shipped"
    ranks = _processes(python, script, args, world, tmp, variant)
    wall = time.perf_counter() - t0
    if ranks is None:
        return {
            "samples_s": float("nan"),
            "accuracy": float("nan"),
            "wall_s": wall,
            "failed": f"did not finish in {PEER_TIMEOUT:.0f} s",
        }
    span = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    out = {
        "samples_s": sum(r["samples"] for r in ranks) / span,
        "accuracy": ranks[0]["accuracy"],
        "wall_s": wall,
    }
    if pdb:  # of the replicas' pushes, how many were applied
        out["applied"] = ranks[0].get("applied")
        out["pushes"] = replicas * STEPS
    return out


def run_netpart(mode: str, replicas: int, tmp: Path, seed: int) -> dict:
    out = tmp / f"np-{mode}-{replicas}-{time.monotonic_ns()}"
    cmd = [
        str(Path(sys.executable).with_name("netpart")),
        *"train --model digits-mlp --workers 1 --replicas".split(),
        str(replicas),
        *"--ps-shards 1 --mode".split(),
        mode,
        *"--optimizer sgd --lr".split(),
        str(LR),
        *"--data digits --steps".split(),
        str(STEPS),
        "--batch",
        str(BATCH),
        *"--n-push 1 --n-fetch 1 --seed".split(),
        str(seed),
        "--out",
        str(out),
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    start = min(x["time"] - x["step_s"] for x in lines)
    span = max(x["time"] for x in lines) - start
    held = json.loads((out / "summary.json").read_text())["held_out"]
    steps_s = sum(x["step_s"] for x in lines if x["replica"] == 0)
    return {
        "samples_s": sum(x["samples"] for x in lines) / span,
        "accuracy": held["accuracy"],
        "wall_s": wall,
        "steps_s": steps_s,
    }


PDBS = ("pytorch-distbelief", "pytorch-distbelief-delivered")
SYSTEMS = {
    1: ("plain", *PDBS, "netpart-downpour"),
    2: (*PDBS, "ddp", "netpart-downpour", "netpart-sync"),
    4: (*PDBS, "ddp", "netpart-downpour", "netpart-sync"),
}


def summarise(runs: list[dict]) -> dict:
    """Medians over the runs that finished; every run's figures; how many did not finish."""
    done = [r for r in runs if "failed" not in r]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in done) if done else float("nan")

    out = {
        "samples_s_median": median("samples_s"),
        "accuracy_median": median("accuracy"),
        "wall_s_median": median("wall_s"),
        "failed": len(runs) - len(done),
        "samples_s": [r["samples_s"] for r in runs],
        "accuracy": [r["accuracy"] for r in runs],
        "wall_s": [r["wall_s"] for r in runs],
    }
    if done and "pushes" in done[0]:  # pytorch-distbelief: updates its server applied in time
        counted = [r for r in done if r.get("applied") is not None]
        out["applied"] = [r.get("applied") for r in runs]
        out["applied_share_median"] = (
            statistics.median(r["applied"] / r["pushes"] for r in counted) if counted else None
        )
    if done and "steps_s" in done[0]:
        out["steps_s_median"] = median("steps_s")
        out["wall_over_steps"] = statistics.median(r["wall_s"] / r["steps_s"] for r in done)
    return out


def print_table(summary: dict) -> None:
    print(f"\n{'system':<34} {'samples/s':>10} {'held-out':>9} {'wall s':>7}  runs (samples/s)")
    for key, s in summary.items():
        runs = ", ".join("hung" if v != v else f"{v:,.0f}" for v in s["samples_s"])
        share = s.get("applied_share_median")
        applied = "" if share is None else f"  (server applied {share:.0%} of the pushes)"
        print(
            f"{key:<34} {s['samples_s_median']:>10,.0f} {s['accuracy_median']:>9.3f} "
            f"{s['wall_s_median']:>7.1f}  {runs}{applied}"
        )


def main() -> int:
    ap = parser("dp_bench", __doc__)
    ap.set_defaults(rounds=2)
    ap.add_argument("--replicas", default="1,2,4")
    args = ap.parse_args()
    python = ensure_peers()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "digits.npz"
        prepare_data(data)
        for rnd in range(args.rounds):
            for replicas in (int(r) for r in args.replicas.split(",")):
                for system in SYSTEMS[replicas]:
                    if system.startswith("netpart-"):
                        res = run_netpart(system.removeprefix("netpart-"), replicas, tmp, rnd)
                    else:
                        res = run_peer(system, replicas, python, data, tmp, rnd)
                    results.setdefault(f"{system}/R={replicas}", []).append(res)
                    print(
                        f"round {rnd + 1} {system} R={replicas}: {res['samples_s']:,.0f} "
                        f"samples/s, held-out {res['accuracy']:.3f}, wall {res['wall_s']:.1f} s"
                        + (f" ({res['failed']})" if "failed" in res else ""),
                        flush=True,
                    )
    summary = {key: summarise(runs) for key, runs in results.items()}
    print_table(summary)
    write_results(args.out, {"job": {"steps": STEPS, "batch": BATCH, "lr": LR}, "results": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
