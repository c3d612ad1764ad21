"""Where every experiment writes its results, and what each result says about how it was made.

Every file an experiment writes to ``experiments/results/`` (or to ``QLM_RESULTS_DIR``, which
``experiments/run_all --quick`` points at a scratch directory) records the command that made it
and the commit it was made at, with ``dirty: true`` when the checkout differed from that commit
in ``qlm/`` or ``experiments/``, its results aside (the result then belongs to no commit: make it
again once the change is committed)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """``QLM_RESULTS_DIR`` if set, else ``experiments/results``; made if missing."""
    path = Path(os.environ.get("QLM_RESULTS_DIR") or REPO / "experiments" / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


_STARTED_AT = (
    _git("rev-parse", "HEAD"),
    bool(_git("status", "--porcelain", "--", "qlm", "experiments", ":!experiments/results")),
)
"""The checkout as the experiment started (a commit made while it runs is not its commit)."""


def provenance(script: str, argv: Sequence[str]) -> dict[str, Any]:
    """``command`` (as a user reruns it, from the repository's root), ``commit`` (the full
    hash of HEAD when the experiment started; "" outside a git checkout) and ``dirty``."""
    command = " ".join(["python", f"experiments/{script}", *argv])
    commit, dirty = _STARTED_AT
    return {"command": command, "commit": commit, "dirty": dirty}


def write_result(
    name: str, script: str, argv: Sequence[str], payload: Mapping[str, Any], *, indent: int = 1
) -> Path:
    """Write ``<results>/<name>.json``: the provenance, then ``payload``'s fields; print the
    command that reproduces it. Returns the path."""
    stamp = provenance(script, argv)
    out = results_dir() / f"{name}.json"
    out.write_text(json.dumps({**stamp, **payload}, indent=indent) + "\n")
    print(
        f"wrote {out} (commit {stamp['commit'][:12] or '?'}{', dirty' if stamp['dirty'] else ''})"
    )
    print(f"reproduce: .venv/bin/{stamp['command']}")
    return out
