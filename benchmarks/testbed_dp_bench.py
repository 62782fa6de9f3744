"""Data parallelism on emulated machines (issue 47): netpart's best parameter-server layout of
M machines against DistributedDataParallel with M replicas on the same M machines, samples/s
and held-out accuracy after the same number of training samples.

The testbed: M machines (`netpart testbed`: a network namespace on a shaped switch and a cpu
cgroup each), `--cpu` of a core and `--link` each. The job is dp_bench's (the digits MLP,
batch 32 per replica, SGD lr 0.05; netpart with n_push = n_fetch = 1). netpart trains the
layout `train --machines M` would (the fastest parameter-server layout predicted for such
machines: this host's description held to the share, as cluster_bench) in Downpour and in
sync, through `netpart train --testbed`; DDP runs one process per machine (dp_bench's
script, file rendezvous on the shared disk, gloo over the machine's link); TensorFlow's
ParameterServerStrategy runs a chief and one ps task on machine 0 and a worker on each other
(installed by this script into benchmarks/.tf-venv, `TF` below says how). Every system
trains SAMPLES samples in all (steps per replica = SAMPLES / (replicas x batch)); samples/s is
each system's own timing of its step loop (netpart: its replicas' metrics after the first
fifth of the steps, as cluster_bench; TensorFlow: the calls scheduled after its first fifth,
until all are done), the systems alternated in rounds, medians. Needs root.

    python benchmarks/testbed_dp_bench.py --out benchmarks/results/testbed_dp_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_bench import HOST, measured_samples_per_s, on_share
from dp_bench import BATCH, DDP, LR, prepare_data

from netpart.cost.machine import read_machine
from netpart.files import write_atomic
from netpart.models import load_spec
from netpart.planning.cluster import advise, trainable
from netpart.testbed import netns
from netpart.testbed.bed import down, read, up

SAMPLES = 28_800  # in all: 300 steps of 3 replicas, 450 of 2
TF_VENV = Path(__file__).resolve().parent / ".tf-venv"  # gitignored: TensorFlow's own env
TF_PIN = "tensorflow-cpu==2.21.0"
TF_PORT = 29710

# TensorFlow's ParameterServerStrategy (DistBelief's successor) on the same job: a chief
# (the coordinator) schedules steps on M - 1 workers whose variables live on one ps task;
# each scheduled tf.function call runs `per_call` steps (the benchmark runs 1 and 10). The
# MLP is built from tf.Variables (no Keras), initialised as torch's nn.Linear, plain SGD,
# every worker its own shuffled stream of the training set.
TF = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
path, steps, batch, lr, seed, role, index, cluster, out, per_call = sys.argv[1:11]
steps, batch, lr, seed, per_call = int(steps), int(batch), float(lr), int(seed), int(per_call)
os.environ["TF_CONFIG"] = json.dumps({"cluster": json.loads(cluster),
                                      "task": {"type": role, "index": int(index)}})
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
if role != "chief":
    tf.distribute.Server(resolver.cluster_spec(), job_name=role, task_index=int(index),
                         protocol="grpc", start=True).join()
strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
d = np.load(path)
X, Y = d["x"].astype("float32"), d["y"].astype("int64")
rng = np.random.default_rng(seed)
def linear(n_in, n_out):
    bound = 1.0 / np.sqrt(n_in)
    w = rng.uniform(-bound, bound, (n_in, n_out)).astype("float32")
    return tf.Variable(w), tf.Variable(rng.uniform(-bound, bound, n_out).astype("float32"))
with strategy.scope():
    params = [v for n_in, n_out in ((64, 256), (256, 256), (256, 10)) for v in linear(n_in, n_out)]
def forward(x):
    h = tf.nn.relu(x @ params[0] + params[1])
    h = tf.nn.relu(h @ params[2] + params[3])
    return h @ params[4] + params[5]
def dataset_fn():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(len(X), seed=seed)
    return ds.repeat().batch(batch)
iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
@tf.function
def train(it):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, forward(x)))
        for v, g in zip(params, tape.gradient(loss, params)):
            v.assign_sub(lr * g)
    for _ in range(per_call):  # unrolled when traced (AutoGraph cannot read `python -c`)
        strategy.run(step, args=next(it))
calls = steps // per_call
warm = calls // 5  # untimed, as netpart's first fifth
for _ in range(warm):
    coordinator.schedule(train, args=(iterator,))
coordinator.join()
t0 = time.perf_counter()
for _ in range(calls - warm):
    coordinator.schedule(train, args=(iterator,))
coordinator.join()
t1 = time.perf_counter()
values = [v.numpy() for v in params]
h = np.maximum(d["x_test"].astype("float32") @ values[0] + values[1], 0)
h = np.maximum(h @ values[2] + values[3], 0)
accuracy = float(((h @ values[4] + values[5]).argmax(1) == d["y_test"]).mean())
json.dump({"samples": (calls - warm) * per_call * batch, "start": t0, "end": t1,
           "accuracy": accuracy}, open(out, "w"))
sys.stdout.flush()
os._exit(0)
"""


def run_netpart(bed: str, layout, mode: str, steps: int, tmp: Path, seed: int) -> dict:
    run = tmp / f"np-{mode}-{time.monotonic_ns()}"
    argv = [
        sys.executable,
        "-m",
        "netpart",
        "train",
        "--testbed",
        bed,
        "--model",
        "digits-mlp",
        "--mode",
        mode,
        "--replicas",
        str(layout.replicas),
        "--workers",
        str(layout.workers),
        "--ps-shards",
        str(layout.shards),
        "--optimizer",
        "sgd",
        "--lr",
        str(LR),
        "--n-push",
        "1",
        "--n-fetch",
        "1",
        "--steps",
        str(steps),
        "--data",
        "digits",
        "--batch",
        str(BATCH),
        "--seed",
        str(seed),
        "--timeout",
        "60",
        "--out",
        str(run),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"netpart {mode}: exit {done.returncode}: {done.stderr[-600:]}")
    held = json.loads((run / "summary.json").read_text())["held_out"]
    out = {"samples_s": measured_samples_per_s(run, layout.replicas), "accuracy": held["accuracy"]}
    shutil.rmtree(run, ignore_errors=True)
    return out


def run_ddp(bed: str, machines: int, steps: int, data: Path, tmp: Path, seed: int) -> dict:
    testbed = read(bed)
    out, store = tmp / f"ddp{time.monotonic_ns()}", tmp / f"store{time.monotonic_ns()}"
    args = [str(data), str(steps), str(BATCH), str(LR), str(seed)]
    procs = []
    for i, host in enumerate(testbed.hosts):
        cmd = [sys.executable, "-c", DDP, *args, str(i), str(machines), str(out), str(store), ""]
        env = {"GLOO_SOCKET_IFNAME": host.device}
        procs.append(subprocess.Popen(testbed.command(i, cmd, env), stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"ddp: exit {p.returncode}: {err.decode()[-600:]}")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(machines)]
    span = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    return {"samples_s": sum(r["samples"] for r in ranks) / span, "accuracy": ranks[0]["accuracy"]}


def ensure_tf() -> Path:
    """TensorFlow's own environment, made once (never a netpart dependency)."""
    python = TF_VENV / "bin" / "python"
    if not python.exists():
        print(f"making {TF_VENV} ({TF_PIN})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(TF_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", TF_PIN, "numpy"], check=True)
    return python


def run_tf(
    bed: str, machines: int, steps: int, data: Path, tmp: Path, seed: int, per_call: int
) -> dict:
    """The chief and the ps task on machine 0, a worker on each other machine."""
    testbed, python = read(bed), ensure_tf()
    hosts = [h.address for h in testbed.hosts]
    cluster = {
        "chief": [f"{hosts[0]}:{TF_PORT}"],
        "ps": [f"{hosts[0]}:{TF_PORT + 1}"],
        "worker": [f"{a}:{TF_PORT}" for a in hosts[1:]],
    }
    out = tmp / f"tf{time.monotonic_ns()}.json"
    roles = [("ps", 0, 0)] + [("worker", i - 1, i) for i in range(1, machines)]
    args = [str(data), str(steps), str(BATCH), str(LR), str(seed)]

    def task(role: str, k: int) -> list[str]:
        return [
            str(python),
            "-c",
            TF,
            *args,
            role,
            str(k),
            json.dumps(cluster),
            str(out),
            str(per_call),
        ]

    servers = [
        subprocess.Popen(
            testbed.command(m, task(role, k)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for role, k, m in roles
    ]
    before = [h.tx_bytes() for h in testbed.hosts]
    try:
        done = subprocess.run(
            testbed.command(0, task("chief", 0)), capture_output=True, text=True, timeout=900
        )
        if done.returncode != 0:
            raise SystemExit(f"tensorflow: exit {done.returncode}: {done.stderr[-600:]}")
    finally:
        for p in servers:  # its servers serve for ever
            p.kill()
            p.wait()
    got = json.loads(out.read_text())
    # what it claims, checked: bytes each machine sent per step (the ps machine: variables
    # read by the workers; each worker: its gradients), over the whole run
    sent = [(h.tx_bytes() - b) / steps for h, b in zip(testbed.hosts, before, strict=True)]
    return {
        "samples_s": got["samples"] / (got["end"] - got["start"]),
        "accuracy": got["accuracy"],
        "sent_per_step": sent,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=3)
    ap.add_argument("--cpu", type=float, default=0.3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    m = args.machines
    network = on_share(read_machine(HOST), args.cpu, netns.rate_bps(args.link)).to_network()
    advice = advise(load_spec("digits-mlp"), m, network, batch=BATCH)
    layout = trainable(advice).layout
    steps_np = SAMPLES // (layout.replicas * BATCH)
    systems = [
        f"netpart {layout.mode} {layout.replicas}x{layout.workers}+{layout.shards}",
        f"netpart {'sync' if layout.mode == 'downpour' else 'downpour'} "
        f"{layout.replicas}x{layout.workers}+{layout.shards}",
        f"ddp x{m}",
        f"tf-ps {m - 1}+1 (1 step a call)",
        f"tf-ps {m - 1}+1 (10 steps a call)",
    ]
    name = f"tdp{os.getpid() % 100000}"
    tmp = Path(tempfile.mkdtemp(prefix="testbed-dp-"))
    data = tmp / "digits.npz"
    prepare_data(data)
    up(name, m, cpu=args.cpu, rate=args.link)
    seen: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        for k in range(args.rounds):
            for system in systems[k % len(systems) :] + systems[: k % len(systems)]:
                if system.startswith("ddp"):
                    got = run_ddp(name, m, SAMPLES // (m * BATCH), data, tmp, k)
                elif system.startswith("tf-ps"):
                    per_call = 10 if "10 steps" in system else 1
                    got = run_tf(name, m, SAMPLES // BATCH, data, tmp, k, per_call)
                else:
                    got = run_netpart(name, layout, system.split()[1], steps_np, tmp, k)
                seen[system].append(got)
                print(
                    f"round {k + 1}: {system:<34} {got['samples_s']:9,.0f} samples/s, "
                    f"held-out {got['accuracy']:.3f}",
                    flush=True,
                )
    finally:
        down(name)
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        s: {
            "samples_s_median": statistics.median(r["samples_s"] for r in v),
            "accuracy_median": statistics.median(r["accuracy"] for r in v),
            "runs": v,
        }
        for s, v in seen.items()
    }
    ddp = summary[systems[2]]["samples_s_median"]
    for s, v in summary.items():
        print(
            f"{s:<34} {v['samples_s_median']:9,.0f} samples/s ({v['samples_s_median'] / ddp:.2f}"
            f"x DDP), held-out {v['accuracy_median']:.3f}"
        )
    if args.out is not None:
        result = {
            "machines": m,
            "cpu": args.cpu,
            "link": args.link,
            "samples": SAMPLES,
            "batch": BATCH,
            "lr": LR,
            "layout": str(layout),
            "results": summary,
        }
        write_atomic(args.out, json.dumps(result, indent=1).encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
