"""Performance model of a serving instance: how long one engine iteration takes, how much KV fits,
how long a model takes to load. The simulated engine is built on it.

The numbers live in ``qlm/data/hardware.json``, written by ``experiments/fit_profiles.py`` from the
third-party measurements shipped in ``qlm/data/profiles/`` (see ``docs/profiles.md`` for each fit and
its source). This module only reads them.

Step time of one iteration (vLLM runs one forward pass over every scheduled request), in ms: the
linear layers follow a roofline (reading the weights bounds small batches, FLOPs bound large ones),
and attention is added on top (its kernels run between the linear layers, not beside them)::

    t = max(base_ms + per_seq_ms * n_scheduled,             weights read, per-sequence overheads
            compute_base_ms + per_token_ms * n_tokens)        linear-layer FLOPs over every token
      + per_ctx_token_ms * sum(ctx of each decode)          decode attention reads the KV cache
      + per_prefill_pair_ms * sum(chunk * (ctx_before + (chunk + 1) / 2))   prefill attention

``n_tokens`` counts one token per decode plus every prompt token of the prefill chunks. A prefill
chunk of ``chunk`` tokens that starts after ``ctx_before`` computed tokens attends to that many
(query, key) pairs.

A measured table can stand in for the formula (``TableStepTime``, read by ``perf_table.py``:
``qlm simulate --perf-model splitwise``), and Splitwise's rule for the KV cache's size for vLLM's
(``kv_memory="splitwise"``).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from qlm.domain import GpuSpec, ModelSpec
from qlm.errors import ConfigError

GIB = 1024**3
GB = 1e9

KvMemoryRule = Literal["vllm", "splitwise"]
KV_MEMORY_RULES: tuple[KvMemoryRule, ...] = ("vllm", "splitwise")

SPLITWISE_MEMORY: dict[str, tuple[float, int]] = {
    "llama-2-70b": (135e9, 2 * 80 * 8192 * 2),
}
"""Splitwise's simulator's model sizes (``configs/model_repo``): weights in bytes, and KV bytes
per token ``2 · layers · hidden · 2`` (its ``estimate_kv_cache_size``: every attention head keeps
K and V, grouped-query attention is not modelled)."""


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Coefficients of the step-time formula in the module docstring (all in milliseconds)."""

    base_ms: float
    per_seq_ms: float
    compute_base_ms: float
    per_token_ms: float
    per_ctx_token_ms: float
    per_prefill_pair_ms: float

    def step_ms(
        self, *, n_scheduled: int, n_tokens: int, decode_ctx: int, prefill_pairs: float
    ) -> float:
        """Duration of one iteration; 0 when nothing is scheduled."""
        if n_scheduled == 0:
            return 0.0
        linear = max(
            self.base_ms + self.per_seq_ms * n_scheduled,
            self.compute_base_ms + self.per_token_ms * n_tokens,
        )
        return (
            linear + self.per_ctx_token_ms * decode_ctx + self.per_prefill_pair_ms * prefill_pairs
        )

    def decode_slope_ms(self, batch: int) -> float:
        """How much longer each decode iteration of ``batch`` sequences is than the one before
        (every sequence attends to one more token)."""
        return self.per_ctx_token_ms * batch


@dataclass(frozen=True, slots=True)
class LinearInterp:
    """Piecewise-linear through ``(xs, ys)`` (``xs`` increasing, at least two points), extended
    beyond both ends along the end segments, as ``scipy.interpolate.interp1d(...,
    fill_value="extrapolate")``. Where that extension reaches zero or below (a falling end
    segment, far from the data), the end point's value is held instead."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) < 2 or len(self.xs) != len(self.ys):
            raise ValueError("an interpolation needs at least two points")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ValueError("interpolation points must be increasing")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if y <= 0:
            return ys[0] if x < x0 else ys[-1]
        return y


@dataclass(frozen=True, slots=True)
class TableStepTime:
    """Step time from measured prefill and decode times, as Splitwise's simulator reads its
    ``perf_model.csv`` (``DatabasePerformanceModel.get_iteration_duration``): both are
    interpolated over the tokens of the batch (prompt size × batch size in the table; in an
    iteration, prefill tokens plus one per decode). A prefill-only iteration takes ``prompt``, a
    decode-only one ``token``, and a mixed one ``prompt`` × 1.1. Context length does not enter."""

    prompt: LinearInterp
    token: LinearInterp
    mixed_factor: float = 1.1

    def step_ms(
        self, *, n_scheduled: int, n_tokens: int, decode_ctx: int, prefill_pairs: float
    ) -> float:
        """Duration of one iteration; 0 when nothing is scheduled."""
        if n_scheduled == 0:
            return 0.0
        if prefill_pairs == 0:
            return self.token(n_tokens)
        ms = self.prompt(n_tokens)
        return ms if decode_ctx == 0 else ms * self.mixed_factor

    def decode_slope_ms(self, batch: int) -> float:
        """Decode time does not grow with the context: every iteration of a run is the same."""
        return 0.0


StepTime = StepTimeModel | TableStepTime


def prefill_pairs(chunk: int, ctx_before: int) -> float:
    """Attention (query, key) pairs of a prefill chunk: each new token attends to all before it."""
    return chunk * (ctx_before + (chunk + 1) / 2)


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Everything the simulated engine needs about one (model, GPU, GPU count) combination."""

    model: ModelSpec
    gpu: GpuSpec
    gpu_count: int
    step: StepTime
    source: str
    disk_load_gbs: float
    load_overhead_s: float
    kv_memory: KvMemoryRule = "vllm"

    def kv_capacity_tokens(self, *, gpu_memory_utilization: float, activation_gb: float) -> int:
        """KV-cache tokens that fit beside the weights, as vLLM sizes its cache at start-up
        (``kv_memory="vllm"``); or by Splitwise's rule: all of the GPUs' memory (GiB) less its
        weights, over its KV bytes per token (``SPLITWISE_MEMORY``)."""
        if self.kv_memory == "splitwise":
            weights, kv_per_token = SPLITWISE_MEMORY[self.model.name]
            free = self.gpu.memory_gb * GIB * self.gpu_count - weights
            if free <= 0:
                raise ConfigError(
                    f"model {self.model.name} does not fit on {self.gpu_count}x{self.gpu.name} "
                    "by Splitwise's memory rule"
                )
            return int(free // kv_per_token)
        usable = self.gpu.memory_gb * self.gpu_count * gpu_memory_utilization
        free_gb = usable - self.model.weights_gb - activation_gb * self.gpu_count
        if free_gb <= 0:
            raise ConfigError(
                f"model {self.model.name} ({self.model.weights_gb} GB) does not fit on "
                f"{self.gpu_count}x{self.gpu.name} ({self.gpu.memory_gb} GB each) at "
                f"gpu_memory_utilization={gpu_memory_utilization}"
            )
        return int(free_gb * GB // self.model.kv_bytes_per_token)

    @property
    def warm_load_s(self) -> float:
        """Weights from CPU memory to the GPU(s): vLLM's wake-up from sleep level 1."""
        per_gpu_gb = self.model.weights_gb / self.gpu_count
        return self.load_overhead_s + per_gpu_gb / self.gpu.host_link_gbs

    @property
    def cold_load_s(self) -> float:
        """Weights from disk to the GPU(s) (the disk is shared, so GPU count does not help)."""
        return self.load_overhead_s + self.model.weights_gb / self.disk_load_gbs

    def kv_transfer_s(self, tokens: int) -> float:
        """Copy ``tokens`` of KV cache one way between GPU and CPU memory."""
        per_gpu_bytes = tokens * self.model.kv_bytes_per_token / self.gpu_count
        return per_gpu_bytes / (self.gpu.host_link_gbs * GB)


@dataclass(frozen=True, slots=True)
class HardwareCatalog:
    """GPUs, models and fitted performance models known to QLM."""

    gpus: dict[str, GpuSpec]
    models: dict[str, ModelSpec]
    perf: dict[tuple[str, str, int], tuple[StepTime, str]]
    disk_load_gbs: float
    load_overhead_s: float
    label: str = ""
    """What chose these performance models (e.g. ``--perf-model splitwise``), named in errors."""
    kv_memory: KvMemoryRule = "vllm"
    """How the KV cache is sized: vLLM's rule or Splitwise's (``PerfModel.kv_capacity_tokens``)."""

    def gpu(self, name: str) -> GpuSpec:
        key = _canonical(name, self.gpus)
        if key is None:
            raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}")
        return self.gpus[key]

    def model(self, name: str) -> ModelSpec:
        key = _canonical(name, self.models)
        if key is None:
            raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}")
        return self.models[key]

    def perf_model(self, model: str, gpu: str, gpu_count: int = 1) -> PerfModel:
        m, g = self.model(model), self.gpu(gpu)
        entry = self.perf.get((m.name, g.name, gpu_count))
        if entry is None:
            have = sorted(f"{k[0]}@{k[2]}x{k[1]}" for k in self.perf)
            raise ConfigError(
                f"{self._prefix()}no performance profile for {m.name} on {gpu_count}x{g.name}; "
                f"have: {', '.join(have)}"
            )
        if self.kv_memory == "splitwise" and m.name not in SPLITWISE_MEMORY:
            raise ConfigError(
                f"--kv-memory splitwise: Splitwise's memory rule has no size for {m.name} "
                f"(it has {', '.join(sorted(SPLITWISE_MEMORY))})"
            )
        step, source = entry
        return PerfModel(
            model=m,
            gpu=g,
            gpu_count=gpu_count,
            step=step,
            source=source,
            disk_load_gbs=self.disk_load_gbs,
            load_overhead_s=self.load_overhead_s,
            kv_memory=self.kv_memory,
        )

    def _prefix(self) -> str:
        return f"{self.label}: " if self.label else ""

    def default_gpu_count(self, model: str, gpu: str) -> int:
        """Fewest GPUs of this type with a profile for the model (e.g. 70B needs several)."""
        m, g = self.model(model), self.gpu(gpu)
        counts = sorted(k[2] for k in self.perf if k[0] == m.name and k[1] == g.name)
        if not counts:
            have = sorted(f"{k[0]}@{k[2]}x{k[1]}" for k in self.perf)
            raise ConfigError(
                f"{self._prefix()}no performance profile for {m.name} on {g.name}; "
                f"have: {', '.join(have)}"
            )
        return counts[0]


def _canonical(name: str, table: dict[str, Any]) -> str | None:
    if name in table:
        return name
    folded = {k.lower(): k for k in table}
    return folded.get(name.lower())


def parse_catalog(doc: dict[str, Any]) -> HardwareCatalog:
    """Build a catalog from the JSON document's structure (see ``qlm/data/hardware.json``)."""
    try:
        gpus = {name: GpuSpec(name=name, **fields) for name, fields in doc["gpus"].items()}
        models = {name: ModelSpec(name=name, **fields) for name, fields in doc["models"].items()}
    except TypeError as exc:  # a missing or unknown field: say which file is wrong, not a traceback
        raise ConfigError(f"hardware catalog: bad GPU or model entry ({exc})") from exc
    perf: dict[tuple[str, str, int], tuple[StepTime, str]] = {}
    for entry in doc["perf_models"]:
        key = (entry["model"], entry["gpu"], int(entry["gpu_count"]))
        if key[0] not in models or key[1] not in gpus:
            raise ConfigError(f"perf model {key} names an unknown model or GPU")
        coeffs = {f: float(entry[f]) for f in StepTimeModel.__dataclass_fields__}
        if any(not math.isfinite(v) or v < 0 for v in coeffs.values()):
            raise ConfigError(f"perf model {key} has a negative or non-finite coefficient")
        perf[key] = (StepTimeModel(**coeffs), str(entry.get("source", "")))
    load = doc["model_load"]
    return HardwareCatalog(
        gpus=gpus,
        models=models,
        perf=perf,
        disk_load_gbs=float(load["disk_load_gbs"]),
        load_overhead_s=float(load["load_overhead_s"]),
    )


@cache
def default_catalog() -> HardwareCatalog:
    """The catalog shipped with QLM (``qlm/data/hardware.json``)."""
    text = resources.files("qlm").joinpath("data/hardware.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))
