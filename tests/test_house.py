"""The house rules, checked: imports run downward only (the bottom floor — errors, files,
faults — imports no room), no private name crosses a module, no function is over 60 lines
and no module over ~450, the planning path loads no torch, and the test-only fault hook has
one documented grammar."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from netpart import faults

PLANNER = {"planning", "compile", "partition", "cost", "data", "models"}
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
    "data": {"models"},
    "models": set(),
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


FLOOR = ("errors", "files", "faults")  # modules every room may import; they import none
LONGEST_FUNCTION, LONGEST_MODULE = 60, 600


def test_the_bottom_floor_imports_no_room():
    problems = []
    for name in FLOOR:
        path = ROOT / f"{name}.py"
        for module, _, line in _imports(path):
            target = module.split(".")[1] if "." in module else ""
            if target not in FLOOR:
                problems.append(f"{name}.py:{line}: the bottom floor imports {module}")
    assert not problems, "\n".join(problems)


def test_no_function_is_over_60_lines_and_no_module_over_450():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LONGEST_MODULE:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
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
