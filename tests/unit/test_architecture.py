"""The pure core imports no I/O library (ARCHITECTURE.md §4 rule 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

QLM = Path(__file__).resolve().parents[2] / "qlm"
PURE = [
    "domain.py",
    "groups",
    "virtual_queues",
    "rct",
    "planner",
    "agents/decide.py",
    "controller.py",
    "engines/sim.py",
    "structured.py",
    "sim",
]
FORBIDDEN = {
    "pika",
    "aio_pika",
    "httpx",
    "sqlalchemy",
    "alembic",
    "fastapi",
    "uvicorn",
    "requests",
    "psycopg",
}


def pure_files() -> list[Path]:
    files: list[Path] = []
    for entry in PURE:
        path = QLM / entry
        files.extend(
            sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
        )
    return files


@pytest.mark.parametrize("path", pure_files(), ids=lambda p: str(p.relative_to(QLM)))
def test_pure_core_module_imports_no_io_library(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{path.name} imports {imported & FORBIDDEN}"


def test_pure_core_reads_no_clock() -> None:
    for path in pure_files():
        text = path.read_text(encoding="utf-8")
        for call in ("time.time(", "time.monotonic(", "datetime.now("):
            assert call not in text, f"{path.name} calls {call}"


def test_pure_core_reads_no_clock_nor_touches_the_process() -> None:
    """Time comes in as ``now``, a clock or a budget object (``qlm.clock``); file descriptors
    and other process state belong to the edge (``qlm.solvers``)."""
    for path in pure_files():
        text = path.read_text(encoding="utf-8")
        for call in ("perf_counter", "process_time", "os.dup2", "os.dup(", "sys.stdout"):
            assert call not in text, f"{path.relative_to(QLM)} uses {call}"


MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "deque", "Counter", "OrderedDict"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in MUTABLE_CALLS
    return False


@pytest.mark.parametrize("path", pure_files(), ids=lambda p: str(p.relative_to(QLM)))
def test_pure_core_keeps_no_module_level_state(path: Path) -> None:
    """No ``global`` rebinding and no module-level mutable container outside an UPPER_CASE
    constant: a policy's state lives in its objects, so two controllers (or a test and the next)
    in one process never share it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        assert not isinstance(node, ast.Global), f"{path.name}:{node.lineno} rebinds a global"
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for target in targets:
            name = target.id if isinstance(target, ast.Name) else ""
            dunder = name.startswith("__") and name.endswith("__")
            if name and not name.isupper() and not dunder and _mutable(value):
                pytest.fail(f"{path.name}:{node.lineno} keeps module-level state in {name}")
