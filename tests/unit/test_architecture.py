"""The shape docs/architecture.md gives the code: every import arrow points down the layers
(``LAYERS``), and the pure core imports no I/O library, reads no clock and keeps no process state
(§4 rule 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

QLM = Path(__file__).resolve().parents[2] / "qlm"

LAYERS: tuple[tuple[str, ...], ...] = (
    # plain data, errors, time, what the MILP solvers need of the process, the services' event
    # loop, JSON text written by hand, the quick constructor of frozen dataclasses: nothing of QLM
    ("errors", "clock", "domain", "structured", "solvers", "eventloop", "jsontext", "frozen"),
    # the parts: engines, the estimator, groups, agent decisions, the durable edges, settings,
    # tracing
    ("engines", "rct", "groups", "agents", "store", "global_queue", "settings", "tracing"),
    # queues of groups; a fleet of the engines' catalog; the log line of a stored outcome
    ("virtual_queues", "fleet", "outcomes"),
    ("planner",),
    ("controller",),
    ("sim",),  # the controller run on simulated engines
    ("profiling", "api", "reports", "wiring"),  # what the service and the CLI stand on
    ("service",),
    ("cli",),
)
"""QLM's packages and modules (under ``qlm.``), lowest layer first. A module imports its own
entry and those of lower layers: never a higher layer, nor a neighbour in its own. A module
belongs to the longest entry its name starts with."""

PURE = [
    "domain.py",
    "groups",
    "virtual_queues",
    "rct",
    "planner",
    "agents",
    "controller.py",
    "engines/sim.py",
    "structured.py",
    "jsontext.py",
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


def _module(path: Path) -> str:
    """``qlm/agents/executor.py`` -> ``agents.executor``; a package's ``__init__`` is the package."""
    parts = path.relative_to(QLM).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _entry(module: str) -> str | None:
    """The ``LAYERS`` entry ``module`` belongs to (the longest that names it or a parent)."""
    entries = [e for layer in LAYERS for e in layer if module == e or module.startswith(e + ".")]
    return max(entries, key=len, default=None)


LAYER_OF = {entry: i for i, layer in enumerate(LAYERS) for entry in layer}
MODULES = {_module(p): p for p in sorted(QLM.rglob("*.py")) if p != QLM / "__init__.py"}


def _qlm_imports(path: Path) -> set[str]:
    """The ``qlm`` modules ``path`` imports (anywhere in it: at the top, in a function or for
    type checking), relative imports resolved, without the ``qlm.`` prefix."""
    module = _module(path).split(".")
    package = module if path.name == "__init__.py" else module[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            names = ["qlm." + ".".join([*base, *([node.module] if node.module else [])])]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.removeprefix("qlm.") for n in names if n.startswith("qlm.")}
    return found


def test_every_module_has_a_layer_and_every_entry_a_module() -> None:
    unplaced = sorted(m for m in MODULES if _entry(m) is None)
    assert not unplaced, f"add these to LAYERS (docs/architecture.md §3): {unplaced}"
    missing = sorted(e for e in LAYER_OF if not any(_entry(m) == e for m in MODULES))
    assert not missing, f"LAYERS names what no longer exists: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module: str) -> None:
    own = _entry(module)
    assert own is not None
    wrong = []
    for imported in sorted(_qlm_imports(MODULES[module])):
        target = _entry(imported)
        if target is not None and target != own and LAYER_OF[target] >= LAYER_OF[own]:
            wrong.append(f"{imported} ({target}, layer {LAYER_OF[target]})")
    assert not wrong, (
        f"qlm.{module} ({own}, layer {LAYER_OF[own]}) imports from its own layer or above: {wrong}"
    )
