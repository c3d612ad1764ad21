"""Fixed-seed ``qlm simulate --json`` cases that a change meant to keep behaviour must leave
identical: W_A, W_B and W_C under every policy, seed 0, two minutes of trace each.

    .venv/bin/python scripts/fixed_cases.py --check          # compare with the recorded outputs
    .venv/bin/python scripts/fixed_cases.py --record         # record them (a behaviour change)
    .venv/bin/python scripts/fixed_cases.py --check -k wb    # only the cases whose name has "wb"

Every field of the summary is compared exactly except those that measure the host (the
planner's wall time). Each case runs in a process of its own, as a user's ``qlm simulate``
does. Exits 1 when a case differs, naming it and the first fields that differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "data" / "fixed_cases.json"
POLICIES = ("fcfs", "fcfs-rr", "edf", "sedf", "priority", "proserve", "shepherd", "qlm")
FLEET_A = "2xA100:llama-3-8b+llama-2-7b+llama-2-13b,1xA100/2:llama-2-70b"
WORKLOADS = {
    "wa": ["--workload", "wa", "--trace", "azure-conv", "--instances", FLEET_A],
    "wb": ["--workload", "wb", "--trace", "azure-code", "--instances", "1xA100:llama-3-8b",
           "--rate-scale", "1.8"],
    "wc": ["--workload", "wc", "--trace", "azure-conv", "--instances", FLEET_A],
    # first-token deadlines: the agents' pull-ahead and the planner's TTFT terms
    "wbt": ["--workload", "wb", "--trace", "azure-conv", "--instances", "1xA100:llama-3-8b",
            "--rate-scale", "1.8", "--ttft-slo", "interactive=1.5"],
}  # fmt: skip
COMMON = ["--seed", "0", "--duration", "120", "--json"]
HOST_FIELDS = ("solve_s_total",)  # wall time of the host: not behaviour


def cases() -> dict[str, list[str]]:
    return {
        f"{w}-{p}": ["simulate", *args, "--policy", p, *COMMON]
        for w, args in WORKLOADS.items()
        for p in POLICIES
    }


def run(args: list[str]) -> dict[str, object]:
    qlm = Path(sys.executable).with_name("qlm")
    out = subprocess.run([str(qlm), *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"qlm {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return strip(json.loads(out.stdout))


def strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in HOST_FIELDS}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def differences(a: object, b: object, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{path}.{key}")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true")
    mode.add_argument("--check", action="store_true")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("-j", type=int, default=2, help="cases run at once")
    opts = parser.parse_args()
    chosen = {name: args for name, args in cases().items() if opts.k in name}
    with ThreadPoolExecutor(opts.j) as pool:
        got = dict(zip(chosen, pool.map(run, chosen.values()), strict=True))
    if opts.record:
        recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
        recorded.update(got)
        RECORDED.parent.mkdir(parents=True, exist_ok=True)
        RECORDED.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(got)} cases in {RECORDED.relative_to(ROOT)}")
        return 0
    recorded = json.loads(RECORDED.read_text())
    failed = 0
    for name, summary in got.items():
        diff = differences(recorded.get(name), summary)
        if diff:
            failed += 1
            print(f"DIFFERS {name}: " + "; ".join(diff[:5]))
        else:
            print(f"same    {name}")
    print(f"{len(got) - failed} of {len(got)} cases identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
