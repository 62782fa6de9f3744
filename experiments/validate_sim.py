"""How far the scaling simulation is from real runs: predicted vs measured step time.

For N in {2, 3, 4}: run the model in N real worker processes on this machine (gloo over
loopback, one thread each, median of timed steps, each step = slowest worker) and predict
the same step from measured slice times with the simulator, told that N processes share this
machine's cores and given a loopback network model measured with gloo. Then across two
network namespaces joined by a veth limited with `tc tbf` (N = 2, one worker per
namespace), predicted with the link's rate. Error = predicted / measured - 1.

    python experiments/validate_sim.py        # ~2 min here; the namespace part needs root

Writes experiments/results/validation.json (and .csv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ and tests/ helpers

from benchmarks.runtime_bench import MID_LOCAL  # noqa: E402
from experiments._common import free_port, write_csv  # noqa: E402
from netpart.files import plan_files, write_atomic, write_files  # noqa: E402
from netpart.partition import plan  # noqa: E402
from netpart.partition.cost import NetworkModel  # noqa: E402
from netpart.partition.simulate import simulate_step  # noqa: E402
from netpart.runtime import run_step  # noqa: E402
from netpart.runtime.check import make_batch  # noqa: E402
from netpart.runtime.result import load_worker_result  # noqa: E402
from netpart.runtime.schedule import plan_schedule  # noqa: E402
from netpart.runtime.trace import measure_slices  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
BATCH, STEPS, WARMUP = 32, 12, 3


def _pingpong(rank: int, port: int, queue, addr: str = "127.0.0.1") -> None:
    """Half of a gloo ping-pong; rank 0 puts the one-way seconds of 64 B and 4 MB on `queue`."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {}
    for name, n in (("small", 16), ("large", 1 << 20)):
        buf = torch.zeros(n)
        laps = []
        for _ in range(30 if name == "small" else 10):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            laps.append(time.perf_counter() - t0)
        out[name] = float(np.median(laps[3:])) / 2  # one way
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _network(t: dict) -> NetworkModel:
    bandwidth = (1 << 20) * 4 * 8 / max(t["large"] - t["small"], 1e-9)
    return NetworkModel(bandwidth_bps=bandwidth, latency_s=t["small"])


def namespace_network(a, b) -> NetworkModel:
    """The same ping-pong between the two namespaces: the link's effective figures."""
    code = (
        "import sys, json, queue; sys.path.insert(0, {root!r}); "
        "from experiments.validate_sim import _pingpong; q = queue.Queue(); "
        "_pingpong({rank}, 29581, q, {addr!r}); print(json.dumps(q.get()) if {rank} == 0 else '')"
    )
    procs = []
    for rank, host in enumerate((a, b)):
        argv = [sys.executable, "-c", code.format(root=str(ROOT), rank=rank, addr=a.address)]
        env = {"GLOO_SOCKET_IFNAME": host.device, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen(host.command(argv, env), stdout=subprocess.PIPE, text=True))
    try:
        out = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return _network(json.loads(out[0].strip().splitlines()[-1]))


def loopback_network() -> NetworkModel:
    """Latency and bandwidth of gloo between two processes here (one-way, median)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_pingpong, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        t = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return _network(t)


def measured_local(spec, p, x, y, repeats: int = 3) -> tuple[float, np.ndarray, np.ndarray]:
    """Median step over `repeats` runs, and the in-situ compute traces: per (layer, worker)
    the forward and backward compute the workers timed in their last step (median of runs)."""
    steps, fwd, bwd = [], [], []
    layers = len(spec.layers)
    for _ in range(repeats):
        result = run_step(spec, p, x, y, dtype=torch.float32, threads=1, steps=STEPS + WARMUP)
        steps.append(float(np.median(np.max(np.array(result.step_times), axis=0)[WARMUP:])))
        for out, phase in ((fwd, "forward"), (bwd, "backward")):
            out.append([[c.get((i, phase), 0.0) for c in result.compute_s] for i in range(layers)])
    return float(np.median(steps)), np.median(fwd, axis=0), np.median(bwd, axis=0)


def predicted(spec, p, net: NetworkModel, cores: int | None, traces=None) -> float:
    """Simulated step: from isolated slice timings, or from given (forward, backward) traces."""
    fwd, bwd = traces if traces is not None else _isolated(spec, p)
    _, schedule = plan_schedule(spec, p, validate=False)
    return simulate_step(fwd, bwd, schedule.traffic(), BATCH, net, cores).step_s


def _isolated(spec, p):
    times = measure_slices(spec, p, BATCH)
    return times.forward, times.backward


def measured_namespaces(spec, p, x, y, rate: str):
    """(step, forward and backward traces, measured link) of two workers in two namespaces
    over a tbf-limited veth; None where namespaces cannot be made."""
    from tests import netns

    why = netns.unavailable()
    if why is not None:
        print(f"skipping the namespace run: {why}")
        return None
    with tempfile.TemporaryDirectory(prefix="netpart-val-") as tmp, \
            netns.two_hosts(rate=rate, burst="32kb") as (a, b):  # fmt: skip
        link = namespace_network(a, b)
        job = Path(tmp)
        files = plan_files(p)
        files["spec.json"] = spec.to_json().encode()
        config = {"seed": 0, "dtype": "float32", "timeout": 120, "threads": 1,
                  "steps": STEPS + WARMUP}  # fmt: skip
        files["config.json"] = json.dumps(config).encode()
        write_files(job, files)
        torch.save({"inputs": x, "targets": y}, job / "batch.pt")
        port = 29571
        store = (
            "import datetime, time, torch.distributed as d; "
            f"s = d.TCPStore('{a.address}', {port}, 3, True, "
            "timeout=datetime.timedelta(seconds=120), wait_for_workers=False); time.sleep(300)"
        )
        env = {"PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen(a.command([sys.executable, "-c", store], env))]
        time.sleep(1.0)
        try:
            for rank, host in enumerate((a, b)):
                wenv = {**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": a.address,
                        "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": host.device}  # fmt: skip
                argv = [sys.executable, "-m", "netpart.runtime.worker_main", "--job", str(job)]
                procs.append(subprocess.Popen(host.command(argv, wenv)))
            for proc in procs[1:]:
                if proc.wait(timeout=300) != 0:
                    raise RuntimeError("a worker in a namespace failed")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = [load_worker_result(job / f"result_{r}.pt") for r in range(2)]
    times = np.array([r.step_times for r in results])
    fwd, bwd = (
        np.array(
            [[r.compute_s.get((i, ph), 0.0) for r in results] for i in range(len(spec.layers))]
        )
        for ph in ("forward", "backward")
    )
    return float(np.median(times.max(axis=0)[WARMUP:])), fwd, bwd, link


def _row(setup: str, n: int, measured: float, isolated: float, insitu: float) -> dict:
    return {"setup": setup, "workers": n, "measured_ms": measured * 1e3,
            "predicted_ms": isolated * 1e3, "error": isolated / measured - 1,
            "predicted_insitu_ms": insitu * 1e3, "error_insitu": insitu / measured - 1}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,3,4")
    ap.add_argument("--rate", default="50mbit", help="namespace link rate (tc tbf)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    spec = MID_LOCAL
    x, y = make_batch(spec, BATCH, 0)
    x = x.float()
    net = loopback_network()
    cores = os.cpu_count() or 1
    print(f"loopback gloo: latency {net.latency_s * 1e6:.0f} us, "
          f"{net.bandwidth_bps / 1e9:.1f} Gbit/s; {cores} cores")  # fmt: skip
    rows = []
    for n in (int(v) for v in args.workers.split(",")):
        p = plan(spec, n, "metis", seed=0, batch=BATCH)
        measured, fwd, bwd = measured_local(spec, p, x, y)
        isolated = predicted(spec, p, net, cores)
        insitu = predicted(spec, p, net, cores, (fwd, bwd))
        rows.append(_row(f"{n} processes, this machine", n, measured, isolated, insitu))
    p = plan(spec, 2, "metis", seed=0, batch=BATCH)
    got = measured_namespaces(spec, p, x, y, args.rate)
    if got is not None:
        measured, fwd, bwd, link = got
        print(f"{args.rate} veth through gloo: latency {link.latency_s * 1e6:.0f} us, "
              f"{link.bandwidth_bps / 1e6:.1f} Mbit/s effective")  # fmt: skip
        isolated = predicted(spec, p, link, None)
        insitu = predicted(spec, p, link, None, (fwd, bwd))
        rows.append(_row(f"2 namespaces, {args.rate} veth", 2, measured, isolated, insitu))
    for r in rows:
        print(f"{r['setup']:<30} measured {r['measured_ms']:6.1f} ms; predicted from isolated "
              f"slices {r['predicted_ms']:6.1f} ms ({r['error']:+.0%}), from in-run compute "
              f"{r['predicted_insitu_ms']:6.1f} ms ({r['error_insitu']:+.0%})")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"model": spec.name, "batch": BATCH, "network": net.to_dict(), "rows": rows,
           "link": link.to_dict() if got is not None else None}  # fmt: skip
    write_atomic(args.out / "validation.json", json.dumps(doc, indent=1).encode())
    write_csv(args.out / "validation.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
