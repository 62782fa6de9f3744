"""How far the scaling simulation is from real runs: predicted vs measured step time.

For each model (`bench-local`, 10M parameters, and `bench-local-wide`, 32M) and N in
{2, 3, 4}: run the model in N real worker processes on this machine (gloo over
loopback, one thread each, median of timed steps, each step = slowest worker) and predict
the same step from measured slice times with the simulator, told that N processes share this
machine's cores and given a loopback network model measured with gloo. Then with one worker
in each of N network namespaces on a bridge whose ports are limited with `tc tbf` (emulated
machines on a switch), predicted with the link as gloo measures it. Links are measured as the
runtime uses them: latency from a small ping-pong, bandwidth from 1 MB sent both ways at
once. Error = predicted / measured - 1.

    python experiments/validate_sim.py        # ~6 min here; the namespace part needs root

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

from benchmarks.runtime_bench import MID_LOCAL, WIDE_LOCAL  # noqa: E402
from experiments._common import free_port, write_csv  # noqa: E402
from netpart.files import plan_files, write_atomic, write_files  # noqa: E402
from netpart.partition import plan  # noqa: E402
from netpart.partition.cost import NetworkModel  # noqa: E402
from netpart.partition.schedule import plan_schedule  # noqa: E402
from netpart.partition.simulate import simulate_step  # noqa: E402
from netpart.runtime import run_step  # noqa: E402
from netpart.runtime.check import make_batch  # noqa: E402
from netpart.runtime.result import load_worker_result  # noqa: E402
from netpart.runtime.trace import measure_slices  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
BATCH, STEPS, WARMUP = 32, 12, 3
BOTH = 1 << 18  # float32 values sent both ways at once to measure a link: 1 MB, a few times
# one layer's halo exchange in these models (150-340 KB each way)


def _pingpong(rank: int, port: int, queue, addr: str = "127.0.0.1") -> None:
    """Half of a gloo ping-pong; rank 0 puts on `queue` the one-way seconds of 64 B and 4 MB,
    and of 1 MB sent both ways at once ("both": how the runtime's exchanges use a link)."""
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
    send, recv, laps = torch.zeros(BOTH), torch.zeros(BOTH), []
    for _ in range(15):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(send, 1 - rank), dist.irecv(recv, 1 - rank)]
        for work in works:
            work.wait()
        laps.append(time.perf_counter() - t0)
    out["both"] = float(np.median(laps[3:]))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _network(t: dict) -> NetworkModel:
    """Latency from the small ping-pong; bandwidth from 1 MB sent both ways at once, as the
    runtime's exchanges send (on a shaped link the two directions' ACKs queue behind each
    other's data, so this is lower than the one-way ping-pong rate, also reported)."""
    bandwidth = BOTH * 4 * 8 / max(t["both"] - t["small"], 1e-9)
    return NetworkModel(bandwidth_bps=bandwidth, latency_s=t["small"])


def namespace_network(a, b) -> dict:
    """The same ping-pong between two namespaces: raw timings (seconds, see `_pingpong`)."""
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
    return json.loads(out[0].strip().splitlines()[-1])


def loopback_network() -> dict:
    """The ping-pong between two processes here: raw timings (seconds, see `_pingpong`)."""
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
    return t


def _describe(t: dict) -> str:
    net = _network(t)
    one_way = (1 << 20) * 4 * 8 / max(t["large"] - t["small"], 1e-9)
    return (
        f"latency {net.latency_s * 1e6:.0f} us, {net.bandwidth_bps / 1e6:.1f} Mbit/s both ways "
        f"at once ({one_way / 1e6:.1f} Mbit/s one way)"
    )


def measured_local(spec, p, x, y, repeats: int = 3) -> tuple[float, np.ndarray, np.ndarray]:
    """Median step over `repeats` runs, and the in-situ compute traces: per (layer, worker)
    the forward and backward compute the workers timed in their last step (median of runs)."""
    steps, fwd, bwd = [], [], []
    layers = len(spec.layers)
    for _ in range(repeats):
        result = run_step(spec, p, x, y, dtype=torch.float32, threads=1, steps=STEPS + WARMUP)
        steps.append(float(np.median(result.slowest_steps()[WARMUP:])))
        for out, phase in ((fwd, "forward"), (bwd, "backward")):
            out.append([[c.get((i, phase), 0.0) for c in result.compute_s] for i in range(layers)])
    return float(np.median(steps)), np.median(fwd, axis=0), np.median(bwd, axis=0)


def predicted(spec, p, net: NetworkModel, cores: int | None, traces) -> float:
    """Simulated step from (forward, backward) slice traces [L, N]."""
    fwd, bwd = traces
    _, schedule = plan_schedule(spec, p, validate=False)
    return simulate_step(fwd, bwd, schedule.traffic(), BATCH, net, cores).step_s


def _isolated(spec, p):
    """Every slice of `p` timed alone (what the scaling experiment simulates from)."""
    times = measure_slices(spec, p, BATCH)
    return times.forward, times.backward


def measured_namespaces(spec, p, x, y, rate: str):
    """(step, forward and backward traces, link timings) of one worker in each of
    `p.workers` namespaces on a switch whose ports are tbf-limited to `rate`; None where
    namespaces cannot be made."""
    from tests import netns

    why = netns.unavailable()
    if why is not None:
        print(f"skipping the namespace run: {why}")
        return None
    n = p.workers
    with tempfile.TemporaryDirectory(prefix="netpart-val-") as tmp, \
            netns.switched_hosts(n, rate=rate, burst="32kb") as hosts:  # fmt: skip
        link = namespace_network(hosts[0], hosts[1])
        job = Path(tmp)
        files = plan_files(p)
        files["spec.json"] = spec.to_json().encode()
        config = {"seed": 0, "dtype": "float32", "timeout": 120, "threads": 1,
                  "steps": STEPS + WARMUP}  # fmt: skip
        files["config.json"] = json.dumps(config).encode()
        write_files(job, files)
        torch.save({"inputs": x, "targets": y}, job / "batch.pt")
        port, master = 29571, hosts[0].address
        store = (
            "import datetime, time, torch.distributed as d; "
            f"s = d.TCPStore('{master}', {port}, {n + 1}, True, "
            "timeout=datetime.timedelta(seconds=120), wait_for_workers=False); time.sleep(300)"
        )
        env = {"PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen(hosts[0].command([sys.executable, "-c", store], env))]
        time.sleep(1.0)
        try:
            for rank, host in enumerate(hosts):
                wenv = {**env, "RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": master,
                        "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": host.device}  # fmt: skip
                argv = [sys.executable, "-m", "netpart.runtime.step", "--job", str(job)]
                procs.append(subprocess.Popen(host.command(argv, wenv)))
            for proc in procs[1:]:
                if proc.wait(timeout=300) != 0:
                    raise RuntimeError("a worker in a namespace failed")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = [load_worker_result(job / f"result_{r}.pt")[0] for r in range(n)]
    times = np.array([r.step_times for r in results])
    fwd, bwd = (
        np.array(
            [[r.compute_s.get((i, ph), 0.0) for r in results] for i in range(len(spec.layers))]
        )
        for ph in ("forward", "backward")
    )
    return float(np.median(times.max(axis=0)[WARMUP:])), fwd, bwd, link


def _row(model: str, setup: str, n: int, measured: float, isolated: float, insitu: float) -> dict:
    return {"model": model, "setup": setup, "workers": n, "measured_ms": measured * 1e3,
            "predicted_ms": isolated * 1e3, "error": isolated / measured - 1,
            "predicted_insitu_ms": insitu * 1e3, "error_insitu": insitu / measured - 1}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,3,4")
    ap.add_argument("--rate", default="50mbit", help="namespace link rate (tc tbf)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--models", default="bench-local,bench-local-wide")
    args = ap.parse_args(argv)
    models = {m.name: m for m in (MID_LOCAL, WIDE_LOCAL)}
    loopback = loopback_network()
    net = _network(loopback)
    cores = os.cpu_count() or 1
    print(f"loopback gloo: {_describe(loopback)}; {cores} cores")
    rows, links = [], {}
    for name in args.models.split(","):
        spec = models[name]
        x, y = make_batch(spec, BATCH, 0)
        x = x.float()
        for n in (int(v) for v in args.workers.split(",")):
            p = plan(spec, n, "metis", seed=0, batch=BATCH)
            alone = _isolated(spec, p)
            measured, fwd, bwd = measured_local(spec, p, x, y)
            isolated = predicted(spec, p, net, cores, alone)
            insitu = predicted(spec, p, net, cores, (fwd, bwd))
            rows.append(_row(name, f"{n} processes, this machine", n, measured, isolated, insitu))
            got = measured_namespaces(spec, p, x, y, args.rate)
            if got is None:
                continue
            measured, fwd, bwd, timings = got
            link = links[f"{name} {n}"] = _network(timings)
            print(f"{args.rate} switch ports through gloo: {_describe(timings)}")
            isolated = predicted(spec, p, link, cores, alone)
            insitu = predicted(spec, p, link, cores, (fwd, bwd))
            setup = f"{n} namespaces, {args.rate} switch"
            rows.append(_row(name, setup, n, measured, isolated, insitu))
    for r in rows:
        print(f"{r['model']:<17} {r['setup']:<30} measured {r['measured_ms']:6.1f} ms; "
              f"predicted from isolated slices {r['predicted_ms']:6.1f} ms ({r['error']:+.0%}), "
              f"from in-run compute "
              f"{r['predicted_insitu_ms']:6.1f} ms ({r['error_insitu']:+.0%})")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"models": args.models.split(","), "batch": BATCH, "loopback": loopback,
           "network": net.to_dict(), "rows": rows,
           "links": {k: v.to_dict() for k, v in links.items()}}  # fmt: skip
    write_atomic(args.out / "validation.json", json.dumps(doc, indent=1).encode())
    write_csv(args.out / "validation.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
