"""What the estimator knows about the hardware and the workload, and the file it is kept in.

A ``HardwareProfile`` describes one (model, GPU, GPU count) serving instance in the terms of the
paper's §6: prefill time ``P`` as a function of input tokens, decode time per token ``d`` (in a full
batch, without preemption), the inefficiency factor ``ε`` (decode slowed by preemption and
recompute under continuous batching), token throughput ``Θ`` at saturation, the cost of a prompt
token when the instance is saturated, KV bytes per token, KV capacity and load times per tier. It is
measured by ``qlm.profiling`` (``qlm profile``), never assumed.

An ``RctProfile`` bundles hardware profiles and output-length priors (``NIG`` per workload) and is
read from / written to JSON (``load_profile`` / ``dump_profile``); the estimator loads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from qlm.errors import ConfigError
from qlm.rct.output_model import NIG

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    model: str
    gpu: str
    gpu_count: int
    prefill_base_s: float  # P(I) = prefill_base_s + prefill_per_token_s * I, a request alone
    prefill_per_token_s: float
    input_token_work_s: float  # GPU time of one prompt token when the instance is saturated
    throughput_tps: float  # Θ: output tokens per second at saturation
    decode_per_token_s: float  # d: time per output token in a full batch, pure decode
    decode_alone_s: float  # time per output token of a request running alone
    inefficiency: float  # ε: mean decode time / (O · d), >= 1 when preemption costs
    saturation_batch: float  # requests running in a full batch
    max_num_seqs: int  # the engine's limit on running requests
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    warm_load_s: float
    cold_load_s: float
    source: str = ""
    # Decode attention reads every running request's KV cache: the extra time per decode step per
    # token of context, and the context per request at which ``decode_alone_s`` and
    # ``decode_per_token_s`` were measured (0: decode time depends on the batch size alone).
    decode_per_ctx_token_s: float = 0.0
    decode_ctx_tokens: float = 0.0
    # The engine's token budget per step (vLLM's ``max_num_batched_tokens``: decodes and prompt
    # chunks together); 0 when unknown. Long prompts can keep a batch below its slots with it.
    max_num_batched_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 0:
            raise ConfigError(
                f"hardware profile {self.key}: max_num_batched_tokens must be >= 0 (0: unknown), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.decode_per_ctx_token_s < 0 or self.decode_ctx_tokens < 0:
            raise ConfigError(
                f"hardware profile {self.key}: decode_per_ctx_token_s and decode_ctx_tokens "
                "must be >= 0"
            )
        positive = {
            "throughput_tps": self.throughput_tps,
            "decode_per_token_s": self.decode_per_token_s,
            "inefficiency": self.inefficiency,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"hardware profile {self.key}: {name} must be > 0, got {value}")

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.model, self.gpu, self.gpu_count)

    def prefill_s(self, input_tokens: float) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * input_tokens

    def decode_s(self, batch: float, context_tokens: float | None = None) -> float:
        """Time per output token with ``batch`` requests running: from running alone to the
        saturated batch, linear in the batch size (decode is memory-bound: each step reads the
        weights once and every running request's KV cache). With ``context_tokens`` — the KV
        footprint of the batch — the KV read is counted for that context rather than for the
        profile's context per request: a batch of few long requests that fill the KV cache
        decodes as slowly as a full batch of short ones."""
        # (Comparisons rather than min/max: this runs once per group at every re-estimate.)
        sat = self.saturation_batch
        if sat <= 1:
            base = self.decode_per_token_s
        else:
            frac = (batch - 1) / (sat - 1)
            frac = 0.0 if frac < 0.0 else 1.0 if frac > 1.0 else frac
            base = self.decode_alone_s + (self.decode_per_token_s - self.decode_alone_s) * frac
        per_ctx = self.decode_per_ctx_token_s
        if context_tokens is None or per_ctx <= 0:
            return base
        b = 1.0 if batch < 1 else sat if batch > sat else batch
        ctx = context_tokens if context_tokens > 0 else 0.0
        return base + per_ctx * (ctx - b * self.decode_ctx_tokens)


@dataclass(frozen=True, slots=True)
class RctProfile:
    """Hardware profiles by (model, GPU, GPU count) and output-length priors by workload name."""

    hardware: dict[tuple[str, str, int], HardwareProfile] = field(default_factory=dict)
    output_priors: dict[str, NIG] = field(default_factory=dict)

    def hardware_for(self, model: str, gpu: str, gpu_count: int) -> HardwareProfile:
        """The profile of ``model`` on ``gpu_count`` × ``gpu`` (GPU names in any case)."""
        hw = self.hardware.get((model, gpu, gpu_count))
        if hw is None:
            folded = gpu.casefold()
            hw = next(
                (
                    h
                    for (m, g, c), h in self.hardware.items()
                    if m == model and c == gpu_count and g.casefold() == folded
                ),
                None,
            )
        if hw is None:
            have = ", ".join(f"{m}@{c}x{g}" for m, g, c in sorted(self.hardware))
            raise ConfigError(
                f"no RCT hardware profile for {model} on {gpu_count}x{gpu}; profile it on the "
                f"simulator (`qlm profile hardware --model {model} --gpu {gpu} --gpus "
                f"{gpu_count} --out profile.json`, or `qlm profile server` for a vLLM server) "
                f"and set QLM_PROFILE_FILE=profile.json (have: {have})"
            )
        return hw

    def prior(self, name: str = "default") -> NIG:
        prior = self.output_priors.get(name) or self.output_priors.get("default")
        if prior is None:
            raise ConfigError(f"no output-length prior {name!r} and no 'default' prior in profile")
        return prior

    def merged(self, other: RctProfile) -> RctProfile:
        """This profile with ``other``'s entries added (``other`` wins on the same key)."""
        return RctProfile(
            hardware={**self.hardware, **other.hardware},
            output_priors={**self.output_priors, **other.output_priors},
        )


def dump_profile(profile: RctProfile) -> str:
    doc: dict[str, Any] = {
        "version": PROFILE_VERSION,
        "hardware": [asdict(hw) for _, hw in sorted(profile.hardware.items())],
        "output_priors": {k: asdict(v) for k, v in sorted(profile.output_priors.items())},
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def parse_profile(text: str, source: str = "profile") -> RctProfile:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        found = doc.get("version") if isinstance(doc, dict) else None
        raise ConfigError(f"{source}: profile version {found!r}, expected {PROFILE_VERSION}")
    try:
        hardware = {}
        for entry in doc.get("hardware", []):
            hw = HardwareProfile(**entry)
            hardware[hw.key] = hw
        priors = {
            name: NIG(**{**fields, "shape": tuple(fields.get("shape", ()))})
            for name, fields in doc.get("output_priors", {}).items()
        }
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{source}: not a valid RCT profile ({exc})") from exc
    return RctProfile(hardware=hardware, output_priors=priors)


def default_profile() -> RctProfile:
    """The profile shipped with QLM (``qlm/data/rct_profile.json``, written by
    ``qlm profile all``): every shipped simulated instance type, priors from the shipped traces."""
    text = resources.files("qlm").joinpath("data/rct_profile.json").read_text(encoding="utf-8")
    return parse_profile(text, "qlm/data/rct_profile.json")
