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
