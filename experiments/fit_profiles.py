"""Fit the hardware catalog shipped with QLM (``qlm/data/hardware.json``) from the third-party data in
``qlm/data/profiles/`` and print how far each fit is from its source.

    .venv/bin/python experiments/fit_profiles.py

The step-time formula is the one of ``qlm.engines.perf_model`` (a roofline over the linear layers plus
additive attention terms); every prediction below goes through ``StepTimeModel.step_ms`` itself, so the
errors printed are those of the simulator. ``docs/profiles.md`` explains each fit and derivation. The
output is deterministic: coefficients are rounded to 6 significant digits and keys are sorted.
It imports ``qlm``, so run it from an installed checkout (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

from qlm.engines.perf_model import StepTimeModel, prefill_pairs

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "qlm" / "data" / "profiles"
AIC_CSV = PROFILES / "aiconfigurator" / "aic_static_vllm.csv"
SPLITWISE_CSV = PROFILES / "splitwise" / "perf_model.csv"
VIDUR_CSV = PROFILES / "vidur" / "vidur_linear_ops_per_iteration.csv"
OUT = REPO / "qlm" / "data" / "hardware.json"

COEFFS: tuple[str, ...] = tuple(StepTimeModel.__dataclass_fields__)
BASE, PER_SEQ, COMPUTE_BASE, PER_TOKEN, PER_CTX, PER_PAIR = range(6)
FP16_BYTES = 2
# the catalog keeps 6 significant digits: stable across platforms, far below any fit error
SIG_DIGITS = 6
# The AIC fits first find the smallest achievable worst-case error, then minimise the mean error while
# every point stays within this many (absolute) fractions of that optimum: a point of slack buys a much
# better typical fit (see docs/profiles.md).
MINIMAX_SLACK = 0.01


# --------------------------------------------------------------------------------------------------
# Published facts. Each figure names its source; nothing here was measured by this project.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_gb: float  # nominal HBM/GDDR size as sold (see docs/profiles.md on GB vs GiB)
    memory_bandwidth_gbs: float
    fp16_tflops: float  # dense FP16 tensor-core peak
    pcie_gbs: float  # nominal one-way rate of its PCIe x16 host link
    allreduce_latency_us: float  # one small (decode-sized) all-reduce between GPUs of one server
    allreduce_busbw_gbs: float  # NCCL bus bandwidth of a large all-reduce
    source: str


GPUS: dict[str, Gpu] = {
    "A100": Gpu(
        name="A100",
        memory_gb=80,
        memory_bandwidth_gbs=2039,
        fp16_tflops=312,
        pcie_gbs=32,
        allreduce_latency_us=9,
        allreduce_busbw_gbs=200,
        source=(
            "A100-SXM4-80GB datasheet (2039 GB/s, 312 TFLOPS FP16 dense, PCIe Gen4 x16 = 32 GB/s); "
            "all-reduce: ~9 us per small call for vLLM's custom all-reduce over NVLink (measured on "
            "H100, TP2-8, <=32 KB: sgl-project/sglang PR #2904), ~200 GB/s NCCL busbw on 8x "
            "A100-SXM4-80GB (NVIDIA/nccl-tests issue #149)"
        ),
    ),
    "H100": Gpu(
        name="H100",
        memory_gb=80,
        memory_bandwidth_gbs=3350,
        fp16_tflops=989,
        pcie_gbs=64,
        allreduce_latency_us=9,
        allreduce_busbw_gbs=480,
        source=(
            "H100-SXM5-80GB datasheet (3350 GB/s, 989 TFLOPS FP16 dense, PCIe Gen5 x16 = 64 GB/s); "
            "all-reduce: ~9 us per small call (vLLM custom all-reduce, sgl-project/sglang PR #2904), "
            "480 GB/s NVLS busbw (GTC S62129 as quoted in NVIDIA/nccl issue #1374)"
        ),
    ),
    "A10": Gpu(
        name="A10",
        memory_gb=24,
        memory_bandwidth_gbs=600,
        fp16_tflops=125,
        pcie_gbs=32,
        allreduce_latency_us=42,
        allreduce_busbw_gbs=28 * 32 / 64,
        source=(
            "A10 datasheet (24 GB GDDR6, 600 GB/s, 125 TFLOPS FP16 dense, PCIe Gen4 x16, no NVLink); "
            "all-reduce over PCIe: 42 us for an 8-byte NCCL all-reduce on 8 PCIe Gen4 GPUs "
            "(NVIDIA/nccl issue #1530), busbw 28 GB/s measured on 8 PCIe Gen5 GPUs (NVIDIA/nccl "
            "issue #1639) scaled by Gen4/Gen5 link rate 32/64"
        ),
    ),
}


@dataclass(frozen=True, slots=True)
class Arch:
    """Architecture from the model's Hugging Face ``config.json``; sizes are computed from it."""

    name: str
    hf_repo: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Parameters of the transformer blocks: what Vidur's linear-operator profiles run."""
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down
        norms = 2 * self.hidden
        return self.layers * (attn + mlp + norms)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        # untied input embedding + blocks + final norm + LM head (all four models untie them)
        return self.vocab * self.hidden + self.layer_params + self.hidden + self.lm_head_params

    @property
    def weights_gb(self) -> float:
        return self.params * FP16_BYTES / 1e9

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * FP16_BYTES  # K and V

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: q.k and p.v, 2 FLOPs per multiply-add."""
        return 4 * self.layers * self.heads * self.head_dim


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 128256, 4096, 14336, 32, 32, 8, 8192),
        Arch("llama-2-7b", "meta-llama/Llama-2-7b-hf", 32000, 4096, 11008, 32, 32, 32, 4096),
        Arch("llama-2-13b", "meta-llama/Llama-2-13b-hf", 32000, 5120, 13824, 40, 40, 40, 4096),
        Arch("llama-2-70b", "meta-llama/Llama-2-70b-hf", 32000, 8192, 28672, 80, 64, 8, 4096),
    )
}
# Figures the brief / shared README state, checked against the arithmetic above (printed at run time).
STATED = {
    "llama-3-8b": (16.0, 128),
    "llama-2-7b": (13.5, 512),
    "llama-2-13b": (26.0, 800),
    "llama-2-70b": (140.0, 320),
}
# Llama-3.1-70B (AIConfigurator's 70B) has Llama-2-70B's blocks; only the vocabulary differs.
LLAMA31_70B = Arch(
    "llama-3.1-70b", "meta-llama/Llama-3.1-70B", 128256, 8192, 28672, 80, 64, 8, 131072
)

# vLLM sleep mode, level 1 wake-up (weights copied back from CPU memory) on A100, vLLM blog 2025-10:
# (parameters in billions, seconds). BF16 weights, one GPU. The 235B FP8 point ran on 4 GPUs with a
# different precision and is left out of the fit (it is printed as a check).
WAKE_UP_A100 = ((0.6, 0.26), (4.0, 0.82), (30.0, 2.9))
WAKE_UP_235B_FP8_4GPU = (235.0, 1, 4, 5.5)  # params_b, bytes/param, GPUs, seconds
# Disk -> GPU with vLLM's default loader, A100 + NVMe, vLLM PR #10647: (model, seconds).
DISK_LOAD = (("llama-2-7b", 7.3), ("llama-2-13b", 16.0))


# --------------------------------------------------------------------------------------------------
# Observations: one measured time and the linear pieces of the formula that predict it.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Obs:
    """``y`` ~ max(mem . x, cmp . x) + add . x for the coefficient vector x (ordered as COEFFS)."""

    kind: str  # "ttft", "tpot" or "linear"
    batch: int
    isl: int
    osl: int
    load: int  # what decides the roofline branch: tokens in the iteration
    mem: np.ndarray
    cmp: np.ndarray
    add: np.ndarray
    y: float


def _vec(**kw: float) -> np.ndarray:
    v = np.zeros(len(COEFFS))
    for k, val in kw.items():
        v[COEFFS.index(k)] = val
    return v


def ttft_obs(batch: int, isl: int, y: float) -> Obs:
    """A static batch's TTFT: ONE pure-prefill iteration over batch*isl tokens."""
    return Obs(
        "ttft",
        batch,
        isl,
        0,
        batch * isl,
        _vec(base_ms=1, per_seq_ms=batch),
        _vec(compute_base_ms=1, per_token_ms=batch * isl),
        _vec(per_prefill_pair_ms=batch * prefill_pairs(isl, 0)),
        y,
    )


def tpot_obs(batch: int, isl: int, osl: int, y: float) -> Obs:
    """Mean of the osl-1 decode iterations; decode i attends to isl+i tokens (isl+1 .. isl+osl-1)."""
    mean_ctx = float(np.mean(np.arange(isl + 1, isl + osl)))
    return Obs(
        "tpot",
        batch,
        isl,
        osl,
        batch,
        _vec(base_ms=1, per_seq_ms=batch),
        _vec(compute_base_ms=1, per_token_ms=batch),
        _vec(per_ctx_token_ms=batch * mean_ctx),
        y,
    )


def linear_obs(tokens: int, y: float) -> Obs:
    """Vidur: the linear layers of one iteration over ``tokens`` (decode tokens are sequences)."""
    return Obs(
        "linear",
        tokens,
        0,
        0,
        tokens,
        _vec(base_ms=1, per_seq_ms=tokens),
        _vec(compute_base_ms=1, per_token_ms=tokens),
        _vec(),
        y,
    )


def simulate(step: StepTimeModel, o: Obs) -> float:
    """What the simulated engine would report for this observation (product code, not the LP)."""
    if o.kind == "ttft":
        return step.step_ms(
            n_scheduled=o.batch,
            n_tokens=o.batch * o.isl,
            decode_ctx=0,
            prefill_pairs=o.batch * prefill_pairs(o.isl, 0),
        )
    if o.kind == "tpot":
        steps = [
            step.step_ms(
                n_scheduled=o.batch, n_tokens=o.batch, decode_ctx=o.batch * ctx, prefill_pairs=0
            )
            for ctx in range(o.isl + 1, o.isl + o.osl)
        ]
        return sum(steps) / len(steps)
    # Vidur's operators exclude attention: decode tokens with no context, no prefill pairs
    return step.step_ms(n_scheduled=o.batch, n_tokens=o.batch, decode_ctx=0, prefill_pairs=0)


# --------------------------------------------------------------------------------------------------
# Fitting: the formula is linear in the coefficients once each point's roofline branch is fixed, so
# each fit is a linear programme over relative errors, solved for every threshold assignment of the
# branches (memory-bound below a load, compute-bound above it, per kind) and the best one kept.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LpResult:
    x: np.ndarray
    objective: float


def _solve(
    obs: Sequence[Obs], mem_active: Sequence[bool], free: Sequence[bool], mode: str, cap: float
) -> LpResult | None:
    """mode "max": minimise the largest |relative error|; "mean": minimise the mean, each <= cap."""
    n, k = len(obs), len(COEFFS)
    nv = k + 1 + n  # coefficients, t (max error), e_i (|error_i|)
    # scale columns to comparable magnitudes so HiGHS sees a well-conditioned problem
    design = np.array([o.mem + o.cmp + o.add for o in obs])
    ys = np.array([o.y for o in obs])
    scale = np.ones(nv)
    for j in range(k):
        col = design[:, j]
        nz = col[col > 0]
        if nz.size:
            scale[j] = float(np.median(ys[col > 0]) / np.median(nz))
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    for i, (o, m) in enumerate(zip(obs, mem_active, strict=True)):
        hi, lo = (o.mem, o.cmp) if m else (o.cmp, o.mem)
        r = np.zeros(nv)
        r[:k] = lo - hi  # the assigned branch really is the larger one
        rows.append(r)
        rhs.append(0.0)
        for sign in (1.0, -1.0):  # e_i >= +-(pred/y - 1)
            r = np.zeros(nv)
            r[:k] = sign * (hi + o.add) / o.y
            r[k + 1 + i] = -1.0
            rows.append(r)
            rhs.append(sign)
        r = np.zeros(nv)
        r[k + 1 + i] = 1.0
        r[k] = -1.0  # e_i <= t
        rows.append(r)
        rhs.append(0.0)
    c = np.zeros(nv)
    if mode == "max":
        c[k] = 1.0
    else:
        c[k + 1 :] = 1.0 / n
    bounds = [(0.0, None if f else 0.0) for f in free]
    bounds += [(0.0, cap if mode == "mean" else None)] + [(0.0, None)] * n
    a = np.array(rows) * scale
    res = linprog(c * scale, A_ub=a, b_ub=np.array(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        return None
    x = res.x * scale
    return LpResult(x[:k], float(res.fun))


def _assignments(obs: Sequence[Obs]) -> Iterable[list[bool]]:
    """Every assignment 'memory-bound iff load <= threshold', one threshold per kind of point."""
    kinds = sorted({o.kind for o in obs})
    options = {kd: [-1, *sorted({o.load for o in obs if o.kind == kd})] for kd in kinds}
    combos: list[dict[str, int]] = [{}]
    for kd in kinds:
        combos = [{**cmb, kd: thr} for cmb in combos for thr in options[kd]]
    for cmb in combos:
        yield [o.load <= cmb[o.kind] for o in obs]


def fit_minimax_then_mean(obs: Sequence[Obs], free: Sequence[bool]) -> tuple[np.ndarray, float]:
    """Best worst-case fit, then the best mean fit within MINIMAX_SLACK of that worst case."""
    best_t = math.inf
    for act in _assignments(obs):
        r = _solve(obs, act, free, "max", math.inf)
        if r is not None and r.objective < best_t - 1e-12:
            best_t = r.objective
    cap = best_t + MINIMAX_SLACK
    best: LpResult | None = None
    for act in _assignments(obs):
        r = _solve(obs, act, free, "mean", cap)
        if r is not None and (best is None or r.objective < best.objective - 1e-12):
            best = r
    assert best is not None
    return best.x, best_t


def fit_mean(obs: Sequence[Obs], free: Sequence[bool]) -> np.ndarray:
    """Least mean absolute relative error (robust to the repeated, noisy Vidur measurements)."""
    best: LpResult | None = None
    for act in _assignments(obs):
        r = _solve(obs, act, free, "mean", math.inf)
        if r is not None and (best is None or r.objective < best.objective - 1e-12):
            best = r
    assert best is not None
    return best.x


def sig(v: float) -> float:
    return float(f"{v:.{SIG_DIGITS}g}")


def rounded(x: Iterable[float]) -> StepTimeModel:
    """The coefficients as the catalog stores them (6 significant digits, never negative)."""
    return StepTimeModel(**{c: sig(max(float(v), 0.0)) for c, v in zip(COEFFS, x, strict=True)})


# --------------------------------------------------------------------------------------------------
# Source data
# --------------------------------------------------------------------------------------------------


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


AIC_GROUPS = {  # (AIC model, system, tp) -> catalog entry it fits
    ("meta-llama/Meta-Llama-3.1-8B", "h100_sxm", 1): ("llama-3-8b", "H100", 1),
    ("meta-llama/Meta-Llama-3.1-8B", "a100_sxm", 1): ("llama-3-8b", "A100", 1),
    ("meta-llama/Meta-Llama-3.1-70B", "h100_sxm", 4): ("llama-2-70b", "H100", 4),
}


def load_aic() -> dict[tuple[str, str, int], list[Obs]]:
    groups: dict[tuple[str, str, int], list[Obs]] = defaultdict(list)
    for r in _read(AIC_CSV):
        key = AIC_GROUPS[(r["model"], r["system"], int(r["tp"]))]
        b, isl, osl = int(r["batch"]), int(r["isl"]), int(r["osl"])
        groups[key].append(ttft_obs(b, isl, float(r["ttft_ms"])))
        groups[key].append(tpot_obs(b, isl, osl, float(r["tpot_ms"])))
    return dict(groups)


VIDUR_MODELS = {
    "meta-llama_Llama-2-7b-hf": "llama-2-7b",
    "meta-llama_Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama_Llama-2-70b-hf": "llama-2-70b",
}


def load_vidur() -> dict[tuple[str, str, int], list[Obs]]:
    groups: dict[tuple[str, str, int], list[Obs]] = defaultdict(list)
    for r in _read(VIDUR_CSV):
        gpu, _, model = r["profile"].partition("_")
        key = (VIDUR_MODELS[model], gpu.upper(), int(r["tp"]))
        groups[key].append(linear_obs(int(r["num_tokens"]), float(r["linear_ops_ms_per_iter"])))
    return dict(groups)


# Vidur profiles the catalog uses (TP>1 only for 70B, and 7B TP2 for 13B on 2x A10), and the largest
# batch every profile covers (Llama-3-8B's go further; fitting it over the same range keeps the
# calibration against it comparable)
VIDUR_USED = (
    ("llama-2-70b", "A100", 2),
    ("llama-2-70b", "A100", 4),
    ("llama-2-70b", "A100", 8),
    ("llama-2-70b", "H100", 2),
    ("llama-2-70b", "H100", 4),
    ("llama-2-7b", "A100", 1),
    ("llama-2-7b", "A100", 2),
    ("llama-2-7b", "H100", 1),
    ("llama-3-8b", "A100", 1),
)
VIDUR_MAX_TOKENS = 4096

SPLITWISE_HW = {"a100-80gb": "A100", "h100-80gb": "H100"}  # h100-80gb-pcap: power-capped, unused


def load_splitwise() -> tuple[dict[tuple[str, str, int], list[Obs]], list[str]]:
    """Llama-2-70B runs, repeated measurements averaged; physically inconsistent configs dropped."""
    acc: dict[tuple[str, int, int, int, int], list[tuple[float, float]]] = defaultdict(list)
    for r in _read(SPLITWISE_CSV):
        if r["model"] != "llama2-70b" or r["hardware"] not in SPLITWISE_HW:
            continue
        k = (
            SPLITWISE_HW[r["hardware"]],
            int(r["tensor_parallel"]),
            int(r["batch_size"]),
            int(r["prompt_size"]),
            int(r["token_size"]),
        )
        acc[k].append((float(r["prompt_time"]), float(r["token_time"])))
    groups: dict[tuple[str, str, int], list[Obs]] = defaultdict(list)
    dropped: list[str] = []
    prompt_ms = {k: float(np.mean([p for p, _ in v])) for k, v in acc.items()}
    for k in sorted(acc):
        gpu, tp, b, p, t = k
        half = (gpu, tp, b // 2, p, t)
        # A prefill of b prompts cannot be faster than one of b/2 prompts: such rows did not run the
        # batch they name (see docs/profiles.md), so they are left out of the comparison.
        if half in prompt_ms and prompt_ms[k] < prompt_ms[half]:
            dropped.append(f"{gpu} TP{tp} batch {b} prompt {p}")
            continue
        key = ("llama-2-70b", gpu, tp)
        groups[key].append(ttft_obs(b, p, prompt_ms[k]))
        groups[key].append(tpot_obs(b, p, t, float(np.mean([x for _, x in acc[k]]))))
    return dict(groups), dropped


# --------------------------------------------------------------------------------------------------
# Derivations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionEff:
    """Fraction of peak the attention kernels reach, read off an AIConfigurator fit of Llama-3-8B."""

    decode_bw: float  # KV bytes read per ms vs peak memory bandwidth
    prefill_flops: float  # attention FLOPs per ms vs peak FP16 TFLOPS


def attention_eff(step: StepTimeModel, arch: Arch, gpu: Gpu) -> AttentionEff:
    kv_gb_per_ms = arch.kv_bytes_per_token / 1e9 / step.per_ctx_token_ms
    tflop_per_ms = arch.attn_flops_per_pair / 1e12 / step.per_prefill_pair_ms
    return AttentionEff(
        decode_bw=kv_gb_per_ms * 1000 / gpu.memory_bandwidth_gbs,
        prefill_flops=tflop_per_ms * 1000 / gpu.fp16_tflops,
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Vidur's kernels -> the vLLM AIConfigurator models: one factor for the weight-read (memory) branch
    of the linear roofline and one for its FLOPs (compute) branch, on one GPU type."""

    anchor: str
    mem: float
    cmp: float


UNCALIBRATED = Calibration("none", 1.0, 1.0)


def allreduce_ms(arch: Arch, gpu: Gpu, tp: int) -> tuple[float, float]:
    """(per iteration, per token) cost of tensor parallelism: two all-reduces per block (after
    attention and after the MLP) of a hidden-size FP16 vector per token; a ring moves 2(p-1)/p of it."""
    if tp == 1:
        return 0.0, 0.0
    calls = 2 * arch.layers
    latency = calls * gpu.allreduce_latency_us / 1000
    per_token = (
        calls * arch.hidden * FP16_BYTES * 2 * (tp - 1) / tp / (gpu.allreduce_busbw_gbs * 1e6)
    )
    return latency, per_token


def vidur_derived(
    arch: Arch,
    gpu: Gpu,
    tp: int,
    linear: np.ndarray,
    linear_arch: Arch,
    linear_gpu: Gpu,
    eff: AttentionEff,
    cal: Calibration,
) -> np.ndarray:
    """Vidur's linear roofline (scaled to another model or GPU if need be, and calibrated) + LM head
    + all-reduce + attention from first principles. Returns the 6 coefficients."""
    x = np.zeros(len(COEFFS))
    s_model = arch.layer_params / linear_arch.layer_params  # weights read and FLOPs per token
    s_mem = linear_gpu.memory_bandwidth_gbs / gpu.memory_bandwidth_gbs * cal.mem
    s_cmp = linear_gpu.fp16_tflops / gpu.fp16_tflops * cal.cmp
    x[BASE] = linear[BASE] * s_model * s_mem
    x[PER_SEQ] = linear[PER_SEQ] * s_model * s_mem
    x[COMPUTE_BASE] = linear[COMPUTE_BASE] * s_model * s_cmp
    x[PER_TOKEN] = linear[PER_TOKEN] * s_model * s_cmp
    # Vidur's profiles stop at the last block: the LM head is one more weight read per iteration, at
    # the bandwidth the blocks' weights are read with (it only runs on each sequence's last token, so
    # its FLOPs are negligible beside a prefill's)
    x[BASE] += x[BASE] * arch.lm_head_params / arch.layer_params
    latency, per_token = allreduce_ms(arch, gpu, tp)
    x[[BASE, COMPUTE_BASE]] += latency
    x[[PER_SEQ, PER_TOKEN]] += per_token
    x[PER_CTX] = arch.kv_bytes_per_token / tp / (gpu.memory_bandwidth_gbs * 1e6 * eff.decode_bw)
    x[PER_PAIR] = arch.attn_flops_per_pair / tp / (gpu.fp16_tflops * 1e9 * eff.prefill_flops)
    return x


def calibrate(
    anchor: str, raw: np.ndarray, fitted: StepTimeModel, comm: tuple[float, float]
) -> Calibration:
    """Factors that make the uncalibrated Vidur route reproduce the AIC fit's weight-read time
    (base_ms) and per-token FLOPs time (per_token_ms) of the anchor, all-reduce excluded."""
    latency, per_token = comm
    return Calibration(
        anchor,
        (fitted.base_ms - latency) / (raw[BASE] - latency),
        (fitted.per_token_ms - per_token) / (raw[PER_TOKEN] - per_token),
    )


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorRow:
    entry: str
    against: str
    kind: str
    n: int
    mean: float
    max: float
    worst: str
    ratio: float  # geometric mean of measured / predicted


def errors(entry: str, against: str, step: StepTimeModel, obs: Sequence[Obs]) -> list[ErrorRow]:
    out = []
    for kind in ("ttft", "tpot", "linear"):
        sel = [o for o in obs if o.kind == kind]
        if not sel:
            continue
        pred = np.array([simulate(step, o) for o in sel])
        ys = np.array([o.y for o in sel])
        rel = np.abs(pred / ys - 1)
        w = sel[int(np.argmax(rel))]
        worst = f"n={w.batch}" if w.kind == "linear" else f"B={w.batch},L={w.isl}"
        ratio = float(np.exp(np.mean(np.log(ys / pred))))
        out.append(
            ErrorRow(
                entry, against, kind, len(sel), float(rel.mean()), float(rel.max()), worst, ratio
            )
        )
    return out


def print_table(rows: Sequence[ErrorRow]) -> None:
    head = (
        f"{'entry':<30} {'against':<30} {'kind':<6} {'n':>4} {'mean':>7} {'max':>7} {'worst':<13}"
    )
    print(head + " meas/pred")
    print("-" * (len(head) + 10))
    for r in rows:
        print(
            f"{r.entry:<30} {r.against:<30} {r.kind:<6} {r.n:>4} {r.mean:>7.1%} {r.max:>7.1%} "
            f"{r.worst:<13} {r.ratio:9.2f}"
        )


def name(key: tuple[str, str, int]) -> str:
    return f"{key[0]} {key[1]}x{key[2]}"


# --------------------------------------------------------------------------------------------------
# Model loading
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadFit:
    overhead_s: float
    host_link_a100_gbs: float
    disk_gbs: float


def fit_model_load() -> LoadFit:
    """Wake-up from sleep level 1 = overhead + weights / host link: a straight-line fit to the three
    single-GPU BF16 points gives both. Disk load = the same overhead + weights / disk bandwidth, the
    bandwidth by least squares over the two PR #10647 points with the intercept held at that overhead
    (a free intercept comes out negative on two points, which no loader has)."""
    w = np.array([p * FP16_BYTES for p, _ in WAKE_UP_A100])  # GB (1e9 params * 2 bytes)
    t = np.array([s for _, s in WAKE_UP_A100])
    slope, overhead = np.polyfit(w, t, 1)
    gb = np.array([ARCHS[m].weights_gb for m, _ in DISK_LOAD])
    ts = np.array([s for _, s in DISK_LOAD]) - overhead
    inv_bw = float(gb @ ts / (gb @ gb))
    return LoadFit(float(overhead), float(1 / slope), 1 / inv_bw)


# --------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where to write the catalog")
    args = ap.parse_args(argv)

    print("== Model sizes from the architecture (HF config.json) vs the stated figures")
    for a in ARCHS.values():
        gb, kib = STATED[a.name]
        print(
            f"{a.name:<12} params {a.params / 1e9:6.3f} B  weights {a.weights_gb:7.2f} GB "
            f"(stated {gb})  KV {a.kv_bytes_per_token / 1024:5.0f} KiB/token (stated {kib})"
        )

    l2, l3 = ARCHS["llama-2-70b"], LLAMA31_70B
    extra_lm = l3.lm_head_params - l2.lm_head_params
    print(
        f"AIC's {l3.name} stands in for {l2.name}: same blocks, LM head + "
        f"{extra_lm / 1e9:.2f} B params = "
        f"{extra_lm / (l2.layer_params + l2.lm_head_params):.1%} more weights read per step "
        "(the embedding is looked up, not read whole; not corrected)"
    )

    aic = load_aic()
    vidur = load_vidur()
    splitwise, dropped = load_splitwise()
    all_free = [True] * len(COEFFS)
    linear_free = [True] * 4 + [False] * 2

    steps: dict[tuple[str, str, int], StepTimeModel] = {}
    sources: dict[tuple[str, str, int], str] = {}
    report: list[ErrorRow] = []

    # 1. AIConfigurator: all six coefficients
    for key in sorted(aic):
        x, best_max = fit_minimax_then_mean(aic[key], all_free)
        steps[key] = rounded(x)
        src = next(k for k, v in AIC_GROUPS.items() if v == key)
        proxy = "" if src[0].endswith("8B") else " (Llama-3.1-70B: Llama-2-70B's blocks, 4x vocab)"
        sources[key] = (
            f"all 6 coefficients fitted to AIConfigurator {src[0].split('/')[1]} {src[1]} TP{src[2]} "
            f"TTFT+TPOT grid{proxy}: minimax LP, then mean within +{MINIMAX_SLACK:.0%} of the "
            f"best max ({best_max:.1%})"
        )
        report += errors(name(key), f"AIC {src[1]} TP{src[2]} (fit)", steps[key], aic[key])

    # 2. Attention efficiencies per GPU, from the Llama-3-8B fits
    eff = {
        g: attention_eff(steps[("llama-3-8b", g, 1)], ARCHS["llama-3-8b"], GPUS[g])
        for g in ("A100", "H100")
    }
    eff["A10"] = eff["A100"]  # no A10 data: same kernels, so the A100's fraction of peak
    print("\n== Attention efficiency (fraction of peak) from the Llama-3-8B AIC fits")
    for g, e in eff.items():
        print(
            f"{g:<5} decode KV read {e.decode_bw:.1%} of bandwidth, prefill {e.prefill_flops:.1%}"
        )

    # 3. Vidur linear rooflines, over the token range every Vidur profile covers
    linear: dict[tuple[str, str, int], np.ndarray] = {}
    for key in VIDUR_USED:
        pts = [o for o in vidur[key] if o.load <= VIDUR_MAX_TOKENS]
        linear[key] = fit_mean(pts, linear_free)
        report += errors(f"vidur {name(key)}", "Vidur linear ops (fit)", rounded(linear[key]), pts)

    def derive(
        arch: str, gpu: str, tp: int, lin: tuple[str, str, int], cal: Calibration
    ) -> np.ndarray:
        a, g = ARCHS[arch], GPUS[gpu]
        la, lg = ARCHS[lin[0]], GPUS[lin[1]]
        return vidur_derived(a, g, tp, linear[lin], la, lg, eff[gpu], cal)

    # 4. Calibrate Vidur's kernels to AIConfigurator's on each GPU, on the model both cover there
    cal: dict[str, Calibration] = {}
    for gpu, key in (("A100", ("llama-3-8b", "A100", 1)), ("H100", ("llama-2-70b", "H100", 4))):
        raw = derive(*key, lin=key, cal=UNCALIBRATED)
        report += errors(
            f"raw vidur {name(key)}", "AIC (xcheck, uncalibrated)", rounded(raw), aic[key]
        )
        comm = allreduce_ms(ARCHS[key[0]], GPUS[gpu], key[2])
        cal[gpu] = calibrate(name(key), raw, steps[key], comm)
        calibrated = rounded(derive(*key, lin=key, cal=cal[gpu]))
        report += errors(
            f"cal. vidur {name(key)}", "AIC (xcheck, calibrated)", calibrated, aic[key]
        )
    cal["A10"] = cal["A100"]  # A10 entries start from A100 data
    print("\n== Vidur -> AIConfigurator calibration (factor on weight-read / FLOPs terms)")
    for gpu, c in cal.items():
        print(f"{gpu:<5} anchor {c.anchor:<20} memory x{c.mem:.3f}  compute x{c.cmp:.3f}")

    def put(key: tuple[str, str, int], x: np.ndarray, source: str) -> None:
        steps[key] = rounded(x)
        sources[key] = source

    def how(lin: tuple[str, str, int], gpu: str, tp: int, extra: str = "") -> str:
        c, g = cal[gpu], GPUS[gpu]
        comm = ""
        if tp > 1:
            link = "PCIe" if gpu == "A10" else "NVLink"
            comm = (
                f"; + all-reduce over {link} (2/block, {g.allreduce_latency_us:g} us/call, "
                f"{g.allreduce_busbw_gbs:g} GB/s busbw)"
            )
        return (
            f"linear roofline fitted to Vidur {name(lin)}{extra}, calibrated to AIC on {c.anchor} "
            f"(weights x{c.mem:.3f}, FLOPs x{c.cmp:.3f}); + LM-head read{comm}; attention from KV "
            f"bytes and FLOPs at the {'A100' if gpu == 'A10' else gpu} efficiency of the 8B AIC fit"
        )

    # Llama-2-7B on one A100 / H100 and Llama-2-70B where AIC has nothing: Vidur's own profiles
    for key in (
        ("llama-2-7b", "A100", 1),
        ("llama-2-7b", "H100", 1),
        ("llama-2-70b", "A100", 2),
        ("llama-2-70b", "A100", 4),
        ("llama-2-70b", "H100", 2),
    ):
        put(key, derive(*key, lin=key, cal=cal[key[1]]), how(key, key[1], key[2]))
    # Llama-2-13B: Llama-2-7B's roofline scaled by block parameters (weights and FLOPs); attention
    # from its own KV size and layer count
    ratio13 = ARCHS["llama-2-13b"].layer_params / ARCHS["llama-2-7b"].layer_params
    scaled = f" x 13B/7B block params {ratio13:.3f}"
    for gpu in ("A100", "H100"):
        lin = ("llama-2-7b", gpu, 1)
        put(
            ("llama-2-13b", gpu, 1),
            derive("llama-2-13b", gpu, 1, lin, cal[gpu]),
            how(lin, gpu, 1, scaled),
        )
    # A10: A100 data scaled by memory bandwidth (memory-bound terms) and TFLOPS (compute-bound terms)
    m_ratio = GPUS["A100"].memory_bandwidth_gbs / GPUS["A10"].memory_bandwidth_gbs
    c_ratio = GPUS["A100"].fp16_tflops / GPUS["A10"].fp16_tflops
    to_a10 = f", scaled to A10 (memory-bound terms x{m_ratio:.3f}, compute-bound x{c_ratio:.3f})"
    a100_8b = np.array([getattr(steps[("llama-3-8b", "A100", 1)], c) for c in COEFFS])
    put(
        ("llama-3-8b", "A10", 1),
        a100_8b * np.array([m_ratio, m_ratio, c_ratio, c_ratio, m_ratio, c_ratio]),
        "AIC fit of Llama-3-8B on A100" + to_a10,
    )
    for arch, tp, lin, extra in (
        ("llama-2-7b", 1, ("llama-2-7b", "A100", 1), to_a10),
        ("llama-2-13b", 2, ("llama-2-7b", "A100", 2), scaled + to_a10),
        ("llama-2-70b", 8, ("llama-2-70b", "A100", 8), to_a10),
    ):
        put((arch, "A10", tp), derive(arch, "A10", tp, lin, cal["A10"]), how(lin, "A10", tp, extra))

    # 5. Splitwise: measured Llama-2-70B, compared (not fitted: see docs/profiles.md)
    for key in sorted(splitwise):
        if key in steps:
            report += errors(name(key), "Splitwise (xcheck)", steps[key], splitwise[key])
    # the Vidur route on H100x4, where the catalog uses the AIC fit instead
    report += errors(
        "cal. vidur llama-2-70b H100x4",
        "Splitwise (xcheck)",
        rounded(derive("llama-2-70b", "H100", 4, ("llama-2-70b", "H100", 4), cal["H100"])),
        splitwise[("llama-2-70b", "H100", 4)],
    )

    print("\n== Fit and cross-check errors (relative; meas/pred = geometric mean of the ratio)")
    print_table(report)
    if dropped:
        print(
            "Splitwise configs left out (prefill faster than at half the batch): "
            + "; ".join(dropped)
        )

    load = fit_model_load()
    host = {
        "A100": load.host_link_a100_gbs,
        "A10": load.host_link_a100_gbs,  # same PCIe Gen4 x16 host link as the A100
        "H100": load.host_link_a100_gbs * GPUS["H100"].pcie_gbs / GPUS["A100"].pcie_gbs,
    }
    print("\n== Model loading")
    print(
        f"overhead {load.overhead_s:.3f} s, A100 host link {load.host_link_a100_gbs:.1f} GB/s, "
        f"disk {load.disk_gbs:.2f} GB/s"
    )
    for p, s in WAKE_UP_A100:
        pred = load.overhead_s + p * FP16_BYTES / load.host_link_a100_gbs
        print(f"  wake-up {p:g}B: measured {s:.2f} s, model {pred:.2f} s")
    p, bpp, n, s = WAKE_UP_235B_FP8_4GPU
    pred = load.overhead_s + p * bpp / n / host["A100"]
    print(f"  wake-up {p:g}B FP8 on {n} GPUs (not fitted): measured {s:.2f} s, model {pred:.2f} s")
    for m, s in DISK_LOAD:
        pred = load.overhead_s + ARCHS[m].weights_gb / load.disk_gbs
        print(f"  disk load {m}: measured {s:.2f} s, model {pred:.2f} s")

    doc = build_catalog(steps, sources, host, load, report, dropped)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(f"\nwrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


def build_catalog(
    steps: dict[tuple[str, str, int], StepTimeModel],
    sources: dict[tuple[str, str, int], str],
    host: dict[str, float],
    load: LoadFit,
    report: Sequence[ErrorRow],
    dropped: Sequence[str],
) -> dict[str, object]:
    gpus = {
        g.name: {
            "memory_gb": g.memory_gb,
            "memory_bandwidth_gbs": g.memory_bandwidth_gbs,
            "fp16_tflops": g.fp16_tflops,
            "host_link_gbs": sig(host[g.name]),
        }
        for g in GPUS.values()
    }
    models = {
        a.name: {
            "params_b": sig(a.params / 1e9),
            "weights_gb": round(a.weights_gb, 2),
            "kv_bytes_per_token": a.kv_bytes_per_token,
            "max_context": a.max_context,
        }
        for a in ARCHS.values()
    }
    perf = [
        {
            "model": k[0],
            "gpu": k[1],
            "gpu_count": k[2],
            **{c: getattr(steps[k], c) for c in COEFFS},
            "source": sources[k],
        }
        for k in sorted(steps)
        if k in sources
    ]
    return {
        "_about": (
            "Written by experiments/fit_profiles.py from qlm/data/profiles/ (see docs/profiles.md); "
            "do not edit by hand."
        ),
        "_gpu_sources": {g.name: g.source for g in GPUS.values()},
        "_model_sources": {
            a.name: f"computed from {a.hf_repo} config.json (FP16 weights, FP16 KV)"
            for a in ARCHS.values()
        },
        "_fit_errors": [
            {
                "entry": r.entry,
                "against": r.against,
                "kind": r.kind,
                "points": r.n,
                "mean_rel_error": round(r.mean, 4),
                "max_rel_error": round(r.max, 4),
                "measured_over_predicted": round(r.ratio, 3),
            }
            for r in report
        ],
        "_splitwise_dropped": list(dropped),
        "gpus": gpus,
        "models": models,
        "perf_models": perf,
        "model_load": {
            "disk_load_gbs": sig(load.disk_gbs),
            "load_overhead_s": sig(load.overhead_s),
            "_source": (
                "overhead and A100 host link: straight line through vLLM sleep-mode level-1 wake-up "
                "times (0.6B/4B/30B BF16, A100; vLLM blog 2025-10); disk: vLLM PR #10647 default "
                "loader (Llama-2-7B 7.3 s, 13B 16.0 s, A100 NVMe) with that overhead"
            ),
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
