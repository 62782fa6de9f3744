"""The house rules, checked: imports run downward only (the bottom floor — errors, files,
faults — imports no room) and no two modules import each other, however far round; no
private name crosses a module; no function is over 60 lines and no module over 600 (the
library, the benchmarks and the experiments); no package holds more than 16 modules, and each
says in its docstring the one question it answers; the planning path loads no torch; the
test-only fault hook has one documented grammar."""

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from netpart import faults

PLANNER = {"planning", "compile", "partition", "cost", "data", "models", "nn"}
ROOT = Path(__file__).resolve().parents[1] / "netpart"
# A room may import itself and the rooms below it (errors/files/faults are the bottom floor).
BELOW = {
    "cli": {"train", "calibrate", "runtime", "ps", "processes", "testbed"} | PLANNER,
    "train": {"runtime", "ps", "processes", "testbed"} | PLANNER,
    "calibrate": {"runtime", "ps", "processes", "testbed"} | PLANNER,
    "runtime": {"processes"} | PLANNER - {"planning"},
    "ps": {"compile", "partition", "cost", "models"},
    "processes": set(),
    "testbed": set(),
    "planning": {"compile", "partition", "cost", "data", "models"},
    "compile": {"partition", "cost", "models"},
    "partition": {"cost", "models"},
    "cost": {"models"},
    "data": {"models", "processes"},  # what memory the machine has, before a large read
    "models": {"nn"},  # the reference model is built of netpart.nn's layers
    "nn": set(),  # the DistBelief layers as plain torch modules: nothing of netpart
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("netpart"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("netpart"):
                    yield a.name, [], node.lineno


def test_imports_run_downward_and_no_private_name_crosses_a_module():
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        room = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for module, names, line in _imports(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else ""
            allowed = {room} | BELOW.get(room, set(BELOW)) | {*FLOOR, ""}
            if room in BELOW and target in BELOW and target not in allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {module}")
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if private:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {private} from {module}")
    assert not problems, "\n".join(problems)


FLOOR = ("errors", "files", "faults", "timing")  # modules every room may import; they import none
LONGEST_FUNCTION, LONGEST_MODULE = 60, 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_itself_round_a_cycle():
    """Module-level imports only: an import inside a function runs when it is called."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        targets = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("netpart"):
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("netpart")}
        graph[_module_name(path)] = targets
    graph = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1 and not nxt.startswith(module + "."):
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    cycles = [c for c in cycles if not _through_a_package_init(c)]
    assert not cycles, "\n".join(cycles)


def _through_a_package_init(cycle: str) -> bool:
    """A package's __init__ re-exporting its own modules is not a cycle between rooms."""
    steps = cycle.split(" -> ")
    return any(b.startswith(a + ".") or a.startswith(b + ".") for a, b in itertools.pairwise(steps))


def test_no_package_over_16_modules_and_each_names_its_question():
    problems = []
    for package in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        modules = list(package.glob("*.py"))
        if len(modules) > 16:
            problems.append(f"{package.name}: {len(modules)} modules")
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        if "?" not in doc.split("\n\n")[0]:
            problems.append(f"{package.name}/__init__.py: its docstring asks no question")
    assert not problems, "\n".join(problems)


def test_the_bottom_floor_imports_no_room():
    problems = []
    for name in FLOOR:
        path = ROOT / f"{name}.py"
        for module, _, line in _imports(path):
            target = module.split(".")[1] if "." in module else ""
            if target not in FLOOR:
                problems.append(f"{name}.py:{line}: the bottom floor imports {module}")
    assert not problems, "\n".join(problems)


def test_no_function_is_over_60_lines_and_no_module_over_600():
    """In the library, the benchmarks and the experiments alike."""
    long = []
    paths = [
        p
        for room in (ROOT, ROOT.parent / "benchmarks", ROOT.parent / "experiments")
        for p in sorted(room.rglob("*.py"))
    ]
    for path in paths:
        text = path.read_text()
        if text.count("\n") > LONGEST_MODULE:
            long.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {lines}"
                    )
    assert not long, "\n".join(long)


def test_the_planning_path_loads_neither_torch_nor_networkx():
    code = "import sys, netpart.partition, netpart.cli; print(sorted(m for m in ('torch', 'networkx') if m in sys.modules))"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_fault_grammar():
    assert faults.parse("die:1") == (faults.Fault("die", 1, 0.0),)
    assert faults.parse("die:3@9, slow:1@0.4") == (
        faults.Fault("die", 3, 9.0),
        faults.Fault("slow", 1, 0.4),
    )
    for bad in ("explode:1", "die", "die:x", "die:1@soon"):
        with pytest.raises(ValueError):
            faults.parse(bad)
