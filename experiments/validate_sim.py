"""Fidelity of the simulated instance against NVIDIA AIConfigurator's static-batch estimates.

For every Llama-3.1-8B row (H100 and A100) of ``qlm/data/profiles/aiconfigurator/aic_static_vllm.csv``
this runs the same static batch (batch 1–256, input 128–4096, output 128) on the simulated engine
with the shipped Llama-3-8B profile and compares TTFT and TPOT. Prints the table of errors and
writes ``experiments/results/validate_sim.json`` (every batch) and ``validate_sim.png``.

Reproduce: .venv/bin/python experiments/validate_sim.py
"""

from __future__ import annotations

import csv
import sys
from importlib import resources
from pathlib import Path

from stamp import write_result

from qlm.engines.perf_model import default_catalog
from qlm.sim.static_batch import run_static_batch

GPUS = {"h100_sxm": "H100", "a100_sxm": "A100"}
TOLERANCE = 0.15


def aic_rows() -> list[dict[str, str]]:
    text = (
        resources.files("qlm")
        .joinpath("data/profiles/aiconfigurator/aic_static_vllm.csv")
        .read_text(encoding="utf-8")
    )
    rows = list(csv.DictReader(text.splitlines()))
    return [r for r in rows if r["model"].endswith("Llama-3.1-8B") and r["system"] in GPUS]


def compare() -> list[dict[str, float | str]]:
    catalog = default_catalog()
    out: list[dict[str, float | str]] = []
    for r in aic_rows():
        perf = catalog.perf_model("llama-3-8b", GPUS[r["system"]], int(r["tp"]))
        b, isl, osl = int(r["batch"]), int(r["isl"]), int(r["osl"])
        sim = run_static_batch(perf, batch=b, input_tokens=isl, output_tokens=osl)
        aic_ttft, aic_tpot = float(r["ttft_ms"]), float(r["tpot_ms"])
        out.append(
            {
                "gpu": GPUS[r["system"]],
                "batch": b,
                "isl": isl,
                "osl": osl,
                "aic_ttft_ms": aic_ttft,
                "sim_ttft_ms": sim.ttft_s * 1000,
                "ttft_err": sim.ttft_s * 1000 / aic_ttft - 1,
                "aic_tpot_ms": aic_tpot,
                "sim_tpot_ms": sim.tpot_s * 1000,
                "tpot_err": sim.tpot_s * 1000 / aic_tpot - 1,
            }
        )
    return out


def plot(rows: list[dict[str, float | str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for gpu, marker in (("H100", "o"), ("A100", "s")):
            sel = [r for r in rows if r["gpu"] == gpu]
            ax.scatter(
                [float(r[f"aic_{metric}_ms"]) for r in sel],
                [float(r[f"sim_{metric}_ms"]) for r in sel],
                label=gpu,
                marker=marker,
                s=14,
            )
        lo = min(float(r[f"aic_{metric}_ms"]) for r in rows)
        hi = max(float(r[f"aic_{metric}_ms"]) for r in rows)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"AIConfigurator {metric.upper()} (ms)")
        ax.set_ylabel(f"simulated {metric.upper()} (ms)")
        ax.legend()
    fig.suptitle("Simulated vLLM vs AIConfigurator, Llama-3.1-8B static batches")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    rows = compare()
    print(
        f"{'gpu':5} {'batch':>5} {'isl':>5} {'ttft aic':>10} {'sim':>10} {'err':>7} "
        f"{'tpot aic':>9} {'sim':>8} {'err':>7}"
    )
    for r in rows:
        print(
            f"{r['gpu']:5} {r['batch']:>5} {r['isl']:>5} {r['aic_ttft_ms']:>10.1f} "
            f"{r['sim_ttft_ms']:>10.1f} {100 * float(r['ttft_err']):>6.1f}% "
            f"{r['aic_tpot_ms']:>9.2f} {r['sim_tpot_ms']:>8.2f} {100 * float(r['tpot_err']):>6.1f}%"
        )
    worst = {m: max(abs(float(r[f"{m}_err"])) for r in rows) for m in ("ttft", "tpot")}
    mean = {m: sum(abs(float(r[f"{m}_err"])) for r in rows) / len(rows) for m in ("ttft", "tpot")}
    print(
        f"\n{len(rows)} static batches: TTFT error mean {100 * mean['ttft']:.1f} %, max "
        f"{100 * worst['ttft']:.1f} %; TPOT error mean {100 * mean['tpot']:.1f} %, max "
        f"{100 * worst['tpot']:.1f} % (tolerance {100 * TOLERANCE:.0f} %)"
    )
    out = write_result("validate_sim", "validate_sim.py", sys.argv[1:], {"rows": rows})
    plot(rows, out.with_suffix(".png"))
    return 0 if max(worst.values()) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
