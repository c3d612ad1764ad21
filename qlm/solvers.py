"""The MILP solvers PuLP drives, and what they need of the process: CBC (bundled with PuLP, run
as a subprocess) and HiGHS (``highspy``, in process).

This is the process-level edge of planning: the planner (``qlm.planner.milp``) builds and reads
its programs purely and asks here for a solver object. What the process must remember lives
here, not in the planner: whether HiGHS has greeted yet (its banner must reach neither
standard output nor the log) and how many solves have failed (the first failure is a warning,
later ones debug).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import pulp

log = logging.getLogger(__name__)

SOLVERS = ("cbc", "highs")


@dataclass(slots=True)
class _Process:
    """What this process remembers of its solvers."""

    greeted: bool = False  # HiGHS's banner was printed, where no one reads it
    failures: int = 0  # solves that raised


_PROCESS = _Process()


def available_solvers() -> tuple[str, ...]:
    names = set(pulp.listSolvers(onlyAvailable=True))
    out = ["cbc"] if "PULP_CBC_CMD" in names else []
    if "HiGHS" in names:
        out.append("highs")
    return tuple(out)


def resolve_solver(name: str) -> str:
    """``auto``: HiGHS when ``highspy`` is installed, else CBC (bundled with PuLP)."""
    if name == "auto":
        return "highs" if "highs" in available_solvers() else "cbc"
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; known: auto, {', '.join(SOLVERS)}")
    return name


def _greet_highs_silently() -> None:
    """HiGHS prints a two-line banner (its version and licence) on the process's standard
    output (file descriptor 1, from C++) when the first solver object is made, before PuLP can
    turn its output off: it would corrupt what a command prints there (``qlm simulate
    --json``), and on standard error it would be two lines in no log format among the log's
    (``QLM_LOG_FORMAT=json``). The first object is made here, once per process, with descriptor
    1 pointed at ``/dev/null`` and the C library's buffers flushed before it is put back; later
    objects print nothing, and PuLP runs each solve with its messages off."""
    if _PROCESS.greeted:
        return
    _PROCESS.greeted = True
    import ctypes
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()  # type: ignore[no-untyped-call]
        ctypes.CDLL(None).fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def make_solver(name: str, time_limit_s: float | None, warm: bool) -> Any:
    name = resolve_solver(name)
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.x bundles CBC behind a name it deprecates for 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm)
    if name == "highs":
        if "highs" not in available_solvers():
            raise ValueError("solver 'highs' needs the highspy package (pip install highspy)")
        _greet_highs_silently()
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, warmStart=warm)
    raise ValueError(f"unknown solver {name!r}; known: {', '.join(SOLVERS)}")


def note_failure(solver: str, error: Exception) -> None:
    """A solve raised (PuLP's bundled CBC 2.10 exits with a segmentation fault on some
    warm-started problems under a short limit): logged, the first time in a process as a
    warning, later ones at debug level."""
    _PROCESS.failures += 1
    log.log(
        logging.WARNING if _PROCESS.failures == 1 else logging.DEBUG,
        "the %s solver failed (%s); the plan is the heuristic's (%d failures so far, later ones "
        "logged at debug level)",
        solver,
        error,
        _PROCESS.failures,
    )
