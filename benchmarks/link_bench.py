"""What an emulated link carries: a message each way between two emulated machines through the
runtime's transport (gloo), against the link's rate, for two sizes of the link's token bucket.

`tc tbf` releases at most a bucket of bytes per timer tick, and a packet larger than its
bucket one frame at a time. With a bucket of one frame (1,600 bytes, the emulation's until
2026-11-26) a 1 Gbit/s link carried 20-31% of its rate; with half a millisecond of the rate
(62.5 KB at 1 Gbit/s, until 2026-11-27) the 64 KiB packets of TCP's segmentation offload
were still cut into frames, and the receiving machine's CPU paid for each.
`netns.burst_for(rate)` (half a millisecond, at least 80 KiB) is the default since; this
compares it with half a millisecond. Per rate, bucket and machine (a cpu cgroup at
`--share` of a core, or a whole core by cpuset), the median over `--repeats` of each size,
both directions at once, the slower machine; alternating the buckets. Needs root.

    python benchmarks/link_bench.py --out benchmarks/results/link_bench.json  # ~2 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from netpart.calibrate.emulated import EmulatedRunner  # noqa: E402
from netpart.testbed import cgroups, netns  # noqa: E402
from netpart.testbed.bed import unavailable  # noqa: E402

SIZES = (65_536, 950_000, 4_000_000)  # bytes; 950 kB: bench-local's halo per step at batch 32


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--share", type=float, default=0.45, help="each machine's share of a core")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"link_bench: skipped: {why}")
        return 0
    rows = []
    for rate in args.rates.split(","):
        for cpu in ("quota", "cores"):
            for r in range(args.rounds):
                for burst in (half_ms(rate), netns.burst_for(rate)):
                    rows.append(_measure(rate, burst, cpu, args) | {"round": r})
                    print(_line(rows[-1]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"sizes": SIZES, "share": args.share, "repeats": args.repeats, "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


def half_ms(rate: str) -> str:
    """The testbeds' bucket from 2026-11-26 to 2026-11-27: half a millisecond of the rate."""
    return str(max(1600, round(netns.rate_bps(rate) / 8 * netns.BURST_S)))


def _measure(rate: str, burst: str, cpu: str, args) -> dict:
    """One link: seconds per size, and the rate each size achieved (bits/s, one direction)."""
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(netns.switched_hosts(2, rate=rate, burst=burst))
        groups = stack.enter_context(
            cgroups.cpu_shares(2, args.share) if cpu == "quota" else cgroups.whole_cores(2)
        )
        runner = EmulatedRunner(hosts, groups, args.share if cpu == "quota" else 1.0)
        seconds, _ = runner.link(SIZES, args.repeats, 2)
    achieved = [8 * size / s for size, s in zip(SIZES, seconds, strict=True)]
    return {
        "rate": rate,
        "rate_bps": netns.rate_bps(rate),
        "burst": burst,
        "cpu": cpu,
        "seconds": [float(s) for s in seconds],
        "achieved_bps": achieved,
    }


def _line(row: dict) -> str:
    share = ", ".join(
        f"{size / 1e6:g} MB {a / row['rate_bps']:.0%}"
        for size, a in zip(SIZES, row["achieved_bps"], strict=True)
    )
    return f"{row['rate']} burst {row['burst']} ({row['cpu']}): of the rate {share}"


if __name__ == "__main__":
    sys.exit(main())
