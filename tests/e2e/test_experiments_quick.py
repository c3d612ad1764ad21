"""``experiments/run_all --quick``: every experiment runs end to end on a small input and writes
a result that names the command and the commit it was made at (the shipped results are left
alone: the quick run writes to a scratch directory)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = {  # result name: the script that writes it
    "validate_sim": "validate_sim",
    "rct_accuracy": "rct_accuracy",
    "policies": "policies",
    "ablation": "ablation",
    "heterogeneity": "heterogeneity",
    "sweep_wc_rate": "sweep",
    "sweep_wb_backlog": "sweep",
    "group_size": "group_size",
    "overhead": "overhead",
}


def test_every_experiment_runs_quickly_and_names_its_commit_and_command(tmp_path: Path) -> None:
    shipped = {p.name: p.stat().st_mtime_ns for p in (ROOT / "experiments" / "results").iterdir()}
    env = os.environ | {"QLM_RESULTS_DIR": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "experiments" / "run_all"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    for name, script in RESULTS.items():
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["command"].startswith(f"python experiments/{script}.py"), result["command"]
        assert re.fullmatch(r"[0-9a-f]{40}", result["commit"]) or not head, result["commit"]
        assert result["commit"] == head
        assert isinstance(result["dirty"], bool)
        assert (tmp_path / f"{name}.png").exists()
    after = {p.name: p.stat().st_mtime_ns for p in (ROOT / "experiments" / "results").iterdir()}
    assert after == shipped
