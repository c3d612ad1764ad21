"""The performance model a simulation runs on (``qlm simulate --perf-model NAME|FILE``):
``default``, the fitted step-time formulas of ``qlm/data/hardware.json``; ``splitwise``,
Splitwise's measured table (``qlm/data/profiles/splitwise/perf_model.csv``); or any CSV file of the
same shape.

A table needs the columns ``model, hardware, tensor_parallel, prompt_size, batch_size,
prompt_time, token_time`` (times in ms; others are ignored). It is read as Splitwise's simulator
reads it (``DatabasePerformanceModel.init_predictor``): for each (model, hardware, tensor
parallelism), the median prompt time and the median token time of the rows with the same batch
tokens (``prompt_size × batch_size``), interpolated linearly over batch tokens
(``TableStepTime``). A model or GPU is matched to the catalog's by name, ignoring case and
punctuation (``llama2-70b`` is ``llama-2-70b``), and a hardware name may carry the GPU's memory
(``a100-80gb`` is the 80 GB ``A100``); rows of other models or hardware (``h100-80gb-pcap``) are
not used. The tensor parallelism is the instance's GPU count (``H100/8``). Everything but the step
time — the model's size, the GPUs' memory and links, load times — stays the catalog's.
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections import defaultdict
from dataclasses import replace
from functools import cache
from importlib import resources
from pathlib import Path

from qlm.engines.perf_model import (
    KV_MEMORY_RULES,
    HardwareCatalog,
    KvMemoryRule,
    LinearInterp,
    StepTime,
    TableStepTime,
    default_catalog,
)
from qlm.errors import ConfigError

PERF_MODELS = ("default", "splitwise")
"""The performance models known by name; anything else given is read as a CSV file."""

COLUMNS = (
    "model",
    "hardware",
    "tensor_parallel",
    "prompt_size",
    "batch_size",
    "prompt_time",
    "token_time",
)

SPLITWISE_SOURCE = "Splitwise perf_model.csv (Mutinifni/splitwise-sim, MIT)"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _match_model(name: str, catalog: HardwareCatalog) -> str | None:
    return next((m for m in catalog.models if _key(m) == _key(name)), None)


def _match_gpu(name: str, catalog: HardwareCatalog) -> str | None:
    for g, spec in catalog.gpus.items():
        if _key(name) in (_key(g), _key(f"{g}-{spec.memory_gb:g}gb")):
            return g
    return None


def parse_table(
    text: str, label: str, catalog: HardwareCatalog, source: str = ""
) -> dict[tuple[str, str, int], tuple[StepTime, str]]:
    """Step-time models by (model, GPU, GPU count) from a table's CSV text; ``label`` begins
    every error (e.g. ``--perf-model my.csv``)."""
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ConfigError(
            f"{label}: missing column(s) {', '.join(missing)} (a table needs {', '.join(COLUMNS)}, "
            "as Splitwise's perf_model.csv)"
        )
    groups: dict[tuple[str, str, int], dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    unmatched: set[str] = set()
    for line, row in enumerate(reader, start=2):
        try:
            ints = {c: int(row[c]) for c in ("tensor_parallel", "prompt_size", "batch_size")}
            times = {c: float(row[c]) for c in ("prompt_time", "token_time")}
        except (TypeError, ValueError):
            raise ConfigError(
                f"{label} line {line}: tensor_parallel, prompt_size and batch_size must be "
                "integers and prompt_time and token_time numbers"
            ) from None
        if any(v < 1 for v in ints.values()):
            raise ConfigError(
                f"{label} line {line}: tensor_parallel, prompt_size and batch_size must be >= 1"
            )
        if any(not (math.isfinite(v) and v > 0) for v in times.values()):
            raise ConfigError(f"{label} line {line}: prompt_time and token_time must be > 0 (ms)")
        model = _match_model(row["model"] or "", catalog)
        gpu = _match_gpu(row["hardware"] or "", catalog)
        if model is None or gpu is None:
            unmatched.add(f"{row['model']}@{row['hardware']}")
            continue
        tokens = ints["prompt_size"] * ints["batch_size"]
        groups[(model, gpu, ints["tensor_parallel"])][tokens].append(
            (times["prompt_time"], times["token_time"])
        )
    if not groups:
        raise ConfigError(
            f"{label}: no row names a model and GPU QLM knows (models: "
            f"{', '.join(sorted(catalog.models))}; GPUs: {', '.join(sorted(catalog.gpus))}; "
            f"the table has {', '.join(sorted(unmatched)) or 'no rows'})"
        )
    perf: dict[tuple[str, str, int], tuple[StepTime, str]] = {}
    for key, by_tokens in sorted(groups.items()):
        if len(by_tokens) < 2:
            raise ConfigError(
                f"{label}: {key[0]} on {key[2]}x{key[1]} has one batch size in tokens "
                f"({next(iter(by_tokens))}); interpolation needs two"
            )
        xs = tuple(float(t) for t in sorted(by_tokens))
        prompt = tuple(statistics.median(p for p, _ in by_tokens[int(t)]) for t in xs)
        token = tuple(statistics.median(d for _, d in by_tokens[int(t)]) for t in xs)
        perf[key] = (TableStepTime(LinearInterp(xs, prompt), LinearInterp(xs, token)), source)
    return perf


@cache
def _splitwise() -> dict[tuple[str, str, int], tuple[StepTime, str]]:
    text = (
        resources.files("qlm")
        .joinpath("data/profiles/splitwise/perf_model.csv")
        .read_text(encoding="utf-8")
    )
    return parse_table(text, "--perf-model splitwise", default_catalog(), SPLITWISE_SOURCE)


def load_catalog(perf_model: str = "default", kv_memory: str = "vllm") -> HardwareCatalog:
    """The shipped catalog with the step times ``perf_model`` names (``default``, ``splitwise``
    or a CSV file) and the KV-memory rule ``kv_memory`` (``vllm`` or ``splitwise``)."""
    if kv_memory not in KV_MEMORY_RULES:
        raise ConfigError(f"--kv-memory must be {' or '.join(KV_MEMORY_RULES)}, got {kv_memory!r}")
    rule: KvMemoryRule = "splitwise" if kv_memory == "splitwise" else "vllm"
    base = default_catalog()
    if perf_model == "default":
        return base if rule == "vllm" else replace(base, kv_memory=rule)
    label = f"--perf-model {perf_model}"
    if perf_model == "splitwise":
        perf = _splitwise()
    else:
        path = Path(perf_model)
        if not path.is_file():
            raise ConfigError(
                f"--perf-model: {perf_model!r} is neither {' nor '.join(PERF_MODELS)} nor a CSV file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{label}: cannot read it ({exc})") from None
        perf = parse_table(text, label, base, str(path))
    return replace(base, perf=dict(perf), label=label, kv_memory=rule)
