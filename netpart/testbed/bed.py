"""A named emulated cluster that outlives the command that made it: M machines, each a network
namespace on one shaped switch and a cpu cgroup held to a share of a core (`netns`,
`cgroups`). `netpart testbed up|down|list` manage them; `--testbed NAME` runs a job with one
process per machine, through torchrun as across real machines.

A testbed is recorded in `STATE/<name>.json` (a tmpfs: it goes at reboot with the namespaces
and cgroups it names); `down` kills what runs inside, deletes the namespaces and cgroups and
the record, whichever of them is still there, so it also cleans up after a crash. Needs root.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from netpart.errors import NetpartError
from netpart.files import write_atomic
from netpart.testbed import cgroups, netns

__all__ = [
    "STATE",
    "Testbed",
    "TestbedError",
    "down",
    "health",
    "list_testbeds",
    "read",
    "unavailable",
    "up",
]

STATE = Path("/run/netpart/testbeds")
NAME = re.compile(r"[a-z][a-z0-9-]{0,15}")
SUBNETS = range(10, 100)  # 10.201.<k>.0/24 for testbed k (the test helpers use 0 and 1)


class TestbedError(NetpartError):
    """A testbed cannot be made, found or used (one line)."""

    __test__ = False  # not a test class, whatever pytest guesses from the name


@dataclass(frozen=True)
class Testbed:
    __test__ = False  # not a test class, whatever pytest guesses from the name

    name: str
    machines: int
    cpu: float  # share of one core per machine
    rate: str  # each machine's link, each way (tc syntax: 1gbit)
    subnet: int
    switch: str
    hosts: tuple[netns.Host, ...]
    groups: tuple[str, ...]  # cgroup directories

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Its network namespaces: the switch's, then each machine's."""
        return (self.switch, *(h.netns for h in self.hosts))

    def command(self, i: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`argv` run on machine `i`: inside its cgroup and its namespace."""
        return cgroups.command(Path(self.groups[i]), self.hosts[i].command(argv, env))

    def to_dict(self) -> dict:
        return {**asdict(self), "hosts": [asdict(h) for h in self.hosts]}

    @classmethod
    def from_dict(cls, d: dict) -> Testbed:
        hosts = tuple(netns.Host(**h) for h in d["hosts"])
        return cls(**{**d, "hosts": hosts, "groups": tuple(d["groups"])})


def unavailable() -> str | None:
    """Why machines cannot be emulated here (no root, no network namespaces, no cpu cgroup
    controller), or None."""
    return netns.unavailable() or cgroups.unavailable()


def up(
    name: str,
    machines: int,
    *,
    cpu: float,
    rate: str,
    burst: str | None = None,
    queue: str = "100ms",
) -> Testbed:
    """Make testbed `name` (links' token bucket `burst`, default `netns.burst_for(rate)`);
    TestbedError (one line) if it cannot be made here."""
    if not NAME.fullmatch(name):
        raise TestbedError(
            f"testbed name {name!r}: lower-case letters, digits and '-', "
            "at most 16, starting with a letter"
        )
    if not 1 <= machines <= 64:
        raise TestbedError(f"--machines {machines}: give 1 to 64")
    if not 0 < cpu <= 1:
        raise TestbedError(f"--cpu {cpu}: a share of one core, 0 < share <= 1")
    try:
        netns.rate_bps(rate)
    except ValueError as exc:
        raise TestbedError(f"--link: {exc}") from None
    if why := unavailable():
        raise TestbedError(why)
    if (STATE / f"{name}.json").exists():
        raise TestbedError(f"testbed {name} exists; `netpart testbed down {name}` first")
    used = {tb.subnet for tb in list_testbeds()}
    present = set(netns.namespaces())  # another's namespaces: never made over, never removed
    subnet = next(
        (k for k in SUBNETS if k not in used and not present & _namespaces(k, machines)), None
    )
    if subnet is None:
        raise TestbedError(f"{len(used)} testbeds are up; take one down first")
    names = [f"tb{subnet}h{i}" for i in range(machines)]  # a device name: at most 15 chars
    hosts = tuple(netns.Host(n, n, netns.SUBNET.format(subnet, i + 1)) for i, n in enumerate(names))
    groups = tuple(str(cgroups.CPU / f"netpart-tb-{name}-{i}") for i in range(machines))
    bed = Testbed(name, machines, cpu, rate, subnet, f"tb{subnet}sw", hosts, groups)
    STATE.mkdir(parents=True, exist_ok=True)
    write_atomic(STATE / f"{name}.json", json.dumps(bed.to_dict(), indent=1).encode())
    made: list[str] = []
    groups_made: list[Path] = []
    try:
        netns.build_switch(bed.switch, list(hosts), made, rate=rate, burst=burst, queue=queue)
        for g in groups:
            cgroups.make_group(Path(g), cpu)
            groups_made.append(Path(g))
    except (OSError, ValueError) as exc:  # undo what this call made, and nothing else
        netns.teardown(made)
        cgroups.remove(groups_made)
        (STATE / f"{name}.json").unlink(missing_ok=True)
        raise TestbedError(f"testbed {name}: {exc}") from None
    return bed


def _namespaces(subnet: int, machines: int) -> set[str]:
    """The namespaces a testbed of `machines` on `subnet` makes."""
    return {f"tb{subnet}sw", *(f"tb{subnet}h{i}" for i in range(machines))}


def read(name: str) -> Testbed:
    """Testbed `name` as recorded; TestbedError if there is none."""
    path = STATE / f"{name}.json"
    try:
        return Testbed.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        have = ", ".join(tb.name for tb in list_testbeds()) or "none"
        raise TestbedError(f"no testbed {name!r} (up: {have}); `netpart testbed up`") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TestbedError(
            f"{path}: not a testbed record ({exc}); `netpart testbed down {name}` removes it"
        ) from None


def list_testbeds() -> list[Testbed]:
    """Every recorded testbed (unreadable records skipped)."""
    out = []
    for path in sorted(STATE.glob("*.json")) if STATE.exists() else []:
        try:
            out.append(Testbed.from_dict(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError, OSError):
            continue
    return out


def down(name: str) -> list[str]:
    """Kill what runs in testbed `name`, delete its namespaces, cgroups and record; returns
    what it removed. Works on a half-made or half-removed testbed."""
    removed = []
    try:
        bed = read(name)
    except TestbedError:
        bed = None
    if bed is not None:
        present = set(netns.namespaces())
        names = [n for n in bed.namespaces if n in present]
        netns.teardown(names)
        groups = [Path(g) for g in bed.groups if Path(g).exists()]
        cgroups.remove(groups)
        removed += names + [str(g) for g in groups]
    record = STATE / f"{name}.json"
    if record.exists():
        record.unlink()
        removed.append(str(record))
    return removed


def health(bed: Testbed) -> str:
    """'up', or what is missing."""
    present = set(netns.namespaces())
    missing = [n for n in bed.namespaces if n not in present]
    missing += [g for g in bed.groups if not Path(g).exists()]
    return "up" if not missing else f"broken ({len(missing)} parts gone: down it)"
