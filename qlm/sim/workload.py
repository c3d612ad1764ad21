"""Workloads: turn a ``Trace`` (arrivals and lengths) into ``Request`` objects by seeded rules.

A trace carries no model, SLO or tenant. A ``WorkloadSpec`` says how to assign them, and
``build_requests`` applies it. ``create_workload`` builds the QLM paper's workloads (§8) by name.

Rules of ``build_requests(trace, spec, seed=...)``, request ``i`` of the trace (in arrival order):

1. **Model and SLO class** are drawn independently. Shares are exact, not sampled: a label with
   share ``s`` gets ``floor(s * n)`` requests, the remaining ones go to the largest fractional parts
   (ties to the label listed first), and the labels are then shuffled over the requests with a seeded
   permutation. So a 5 % model gets 5 % of the requests, whatever the seed.
2. **Lengths** are the trace's, at least 1 token each, clamped to the model's context window with
   the input truncated first: ``output = min(output, max_context - 1)``, then
   ``input = min(input, max_context - output)``. Nothing is impossible to serve.
3. **max_tokens**, the client's cap and all a policy may know of the output, is
   ``max(output, min(cap, max_context - input))`` where ``cap`` is ``spec.max_tokens`` or, when that
   is None, the trace's largest output (the cap its clients evidently used: exactly 1000 for Azure
   conv). ``replay_output_tokens`` is the (clamped) trace output.
4. **SLO** is the class's ``e2e_s`` and ``ttft_s`` times ``spec.slo_scale`` (paper Appendix A.1); the
   tier and ``slo_class`` are the class's; the **tenant** is the class's ``tenant``, or its name when
   that is empty (one tenant per application class).
5. **Ids** are ``r000000``, ``r000001``, ... in trace order.
6. **Mega prompts** (``spec.mega``, W_C) are *added*: ``round(share * n)`` requests with ids
   ``m000000``, ... arriving uniformly at random over ``[0, trace.duration_s)``, models drawn by the
   same shares (rule 1), input ``floor(input_fraction * max_context)``, output and max_tokens
   ``floor(output_fraction * max_context)``, SLO class ``mega.slo_class``, label ``("kind", "mega")``.
   The regular requests are exactly those of the same spec without mega prompts.

Every random choice uses a stream spawned from ``seed`` (model, class, mega arrival, mega model), so a
seed gives the same list bit for bit, and adding mega prompts leaves the other draws unchanged.
The result is sorted by arrival (ties: regular requests first, then by id).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from qlm.domain import SLO, Request, Tier
from qlm.engines.perf_model import default_catalog
from qlm.errors import WorkloadError
from qlm.sim.traces import Trace


def model_context(name: str) -> int:
    """Context window (tokens) of a model, from the shipped hardware catalog."""
    return default_catalog().model(name).max_context


PRESETS = ("default", "wa", "wb", "wc")

# SLO values of the presets, in seconds. The paper (§8) gives latency-sensitive services an
# end-to-end SLO under 30 s and batch jobs "several minutes"; its exact values are not published.
INTERACTIVE_E2E_S = 20.0
STANDARD_E2E_S = 60.0
BATCH_E2E_S = 300.0


@dataclass(frozen=True, slots=True)
class SLOClass:
    """One application class: its SLO, tier, tenant and share of the requests."""

    name: str
    e2e_s: float
    tier: Tier
    share: float
    ttft_s: float | None = None
    tenant: str = ""  # empty: the class name

    def __post_init__(self) -> None:
        try:
            SLO(self.e2e_s, self.ttft_s)
        except ValueError as exc:
            raise WorkloadError(f"SLO class {self.name!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ModelShare:
    """One served model, its share of the requests and its context window in tokens."""

    name: str
    share: float
    max_context: int

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise WorkloadError(f"model {self.name!r}: max_context must be >= 2")


@dataclass(frozen=True, slots=True)
class MegaPrompts:
    """Extra requests that fill a model's whole context window (the paper's W_C).

    ``share`` is their number as a fraction of the trace's requests; their input and output are the
    given fractions of the model's ``max_context``.
    """

    share: float
    input_fraction: float = 0.75
    output_fraction: float = 0.25
    slo_class: str = "batch"

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise WorkloadError(f"mega prompts: share must be in [0, 1], got {self.share}")
        if not (
            self.input_fraction > 0
            and self.output_fraction > 0
            and self.input_fraction + self.output_fraction <= 1
        ):
            raise WorkloadError(
                "mega prompts: input_fraction and output_fraction must be > 0 and sum to <= 1, got "
                f"{self.input_fraction} and {self.output_fraction}"
            )


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to turn a trace into requests (see the module docstring for the rules)."""

    name: str
    models: tuple[ModelShare, ...]
    slo_classes: tuple[SLOClass, ...]
    slo_scale: float = 1.0
    max_tokens: int | None = None  # the clients' cap; None: the trace's largest output
    mega: MegaPrompts | None = None

    def __post_init__(self) -> None:
        _check_shares(f"workload {self.name!r} models", [(m.name, m.share) for m in self.models])
        _check_shares(
            f"workload {self.name!r} SLO classes", [(c.name, c.share) for c in self.slo_classes]
        )
        if not (math.isfinite(self.slo_scale) and self.slo_scale > 0):
            raise WorkloadError(
                f"workload {self.name!r}: slo_scale must be > 0, got {self.slo_scale}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise WorkloadError(f"workload {self.name!r}: max_tokens must be >= 1")
        if self.mega is not None and self.mega.slo_class not in {c.name for c in self.slo_classes}:
            raise WorkloadError(
                f"workload {self.name!r}: mega prompts use SLO class {self.mega.slo_class!r}, "
                f"which is not one of {[c.name for c in self.slo_classes]}"
            )


def _check_shares(what: str, shares: list[tuple[str, float]]) -> None:
    if not shares:
        raise WorkloadError(f"{what}: none given")
    names = [name for name, _ in shares]
    if len(set(names)) != len(names):
        raise WorkloadError(f"{what}: duplicate names in {names}")
    if any(not (math.isfinite(s) and s >= 0) for _, s in shares):
        raise WorkloadError(f"{what}: shares must be >= 0, got {dict(shares)}")
    total = sum(s for _, s in shares)
    if abs(total - 1.0) > 1e-6:
        raise WorkloadError(f"{what}: shares must sum to 1, got {total:.6g} from {dict(shares)}")


def exact_counts(shares: list[float], n: int) -> list[int]:
    """Split ``n`` by ``shares`` (summing to 1): floors, then the rest to the largest remainders."""
    quotas = [s * n for s in shares]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _assign(shares: list[float], n: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Label indices for ``n`` items with exact shares, in a seeded random order."""
    labels = np.repeat(np.arange(len(shares), dtype=np.int64), exact_counts(shares, n))
    return rng.permutation(labels)


def build_requests(trace: Trace, spec: WorkloadSpec, *, seed: int = 0) -> list[Request]:
    """The requests of ``trace`` under ``spec``: same ``seed``, same list (see the module rules)."""
    model_seed, class_seed, mega_time_seed, mega_model_seed = np.random.SeedSequence(seed).spawn(4)
    n = len(trace)
    model_shares = [m.share for m in spec.models]
    model_of = _assign(model_shares, n, np.random.default_rng(model_seed)).tolist()
    class_of = _assign([c.share for c in spec.slo_classes], n, np.random.default_rng(class_seed))
    slos = [
        SLO(
            c.e2e_s * spec.slo_scale,
            None if c.ttft_s is None else c.ttft_s * spec.slo_scale,
        )
        for c in spec.slo_classes
    ]
    cap = spec.max_tokens
    if cap is None:
        cap = max(1, int(trace.output_tokens.max())) if n else 1

    requests: list[Request] = []
    arrivals = trace.arrival_s.tolist()
    inputs = trace.input_tokens.tolist()
    outputs = trace.output_tokens.tolist()
    for i, (m, c) in enumerate(zip(model_of, class_of.tolist(), strict=True)):
        model, slo_class = spec.models[m], spec.slo_classes[c]
        ctx = model.max_context
        output = min(max(1, outputs[i]), ctx - 1)
        input_tokens = min(max(1, inputs[i]), ctx - output)
        requests.append(
            Request(
                id=f"r{i:06d}",
                model=model.name,
                input_tokens=input_tokens,
                max_tokens=max(output, min(cap, ctx - input_tokens)),
                arrival_s=arrivals[i],
                slo=slos[c],
                tier=slo_class.tier,
                tenant=slo_class.tenant or slo_class.name,
                slo_class=slo_class.name,
                replay_output_tokens=output,
            )
        )

    mega = spec.mega
    if mega is not None and n:
        count = round(mega.share * n)
        times = np.sort(np.random.default_rng(mega_time_seed).uniform(0.0, trace.duration_s, count))
        mega_models = _assign(model_shares, count, np.random.default_rng(mega_model_seed))
        c = next(i for i, k in enumerate(spec.slo_classes) if k.name == mega.slo_class)
        slo_class = spec.slo_classes[c]
        for j, (t, m) in enumerate(zip(times.tolist(), mega_models.tolist(), strict=True)):
            model = spec.models[m]
            output = math.floor(mega.output_fraction * model.max_context)
            requests.append(
                Request(
                    id=f"m{j:06d}",
                    model=model.name,
                    input_tokens=math.floor(mega.input_fraction * model.max_context),
                    max_tokens=output,
                    arrival_s=t,
                    slo=slos[c],
                    tier=slo_class.tier,
                    tenant=slo_class.tenant or slo_class.name,
                    slo_class=slo_class.name,
                    replay_output_tokens=output,
                    labels=(("kind", "mega"),),
                )
            )
        requests.sort(key=lambda r: (r.arrival_s, r.id[0] == "m", r.id))
    return requests


# --- The paper's workloads --------------------------------------------------------------------


def _wa_models(tail_share: float) -> tuple[ModelShare, ...]:
    if not 0 <= tail_share < 1:
        raise WorkloadError(f"tail_share must be in [0, 1), got {tail_share}")
    shares = {
        "llama-3-8b": 1 - tail_share,
        "llama-2-7b": tail_share * 3 / 6,
        "llama-2-13b": tail_share * 2 / 6,
        "llama-2-70b": tail_share * 1 / 6,
    }
    return tuple(ModelShare(name, s, model_context(name)) for name, s in shares.items())


def _single_model() -> tuple[ModelShare, ...]:
    return (ModelShare("llama-3-8b", 1.0, model_context("llama-3-8b")),)


def _with_interactive_share(
    classes: tuple[SLOClass, ...], share: float | None
) -> tuple[SLOClass, ...]:
    """Give the ``interactive`` class ``share``; rescale the others to fill the rest."""
    if share is None:
        return classes
    if not 0 <= share <= 1:
        raise WorkloadError(f"interactive_share must be in [0, 1], got {share}")
    interactive = [c for c in classes if c.name == "interactive"]
    if not interactive:
        raise WorkloadError("interactive_share: this workload has no 'interactive' class")
    rest = 1 - interactive[0].share
    if rest <= 0 and share < 1:
        raise WorkloadError("interactive_share: no other class to give the rest to")
    return tuple(
        replace(c, share=share if c.name == "interactive" else c.share * (1 - share) / (rest or 1))
        for c in classes
    )


def parse_ttft_slo(text: str) -> dict[str, float]:
    """``CLASS=SECONDS[,CLASS=SECONDS]`` (``qlm simulate --ttft-slo``) as a mapping; each class
    once, each value a number of seconds > 0."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not (name and sep and value):
            raise WorkloadError(f"expected CLASS=SECONDS[,CLASS=SECONDS], got {text!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise WorkloadError(f"{name}: {value!r} is not a number of seconds") from None
        if not (math.isfinite(seconds) and seconds > 0):
            raise WorkloadError(f"{name}: seconds must be > 0, got {value}")
        if name in out:
            raise WorkloadError(f"class {name!r} given twice")
        out[name] = seconds
    return out


def with_ttft(
    classes: tuple[SLOClass, ...], ttft_slo: Mapping[str, float] | None
) -> tuple[SLOClass, ...]:
    """The classes with the TTFT SLOs of ``ttft_slo`` (seconds by class name); a name the
    classes lack, or a TTFT SLO longer than its class's end-to-end SLO, is an error."""
    if not ttft_slo:
        return classes
    names = [c.name for c in classes]
    unknown = sorted(set(ttft_slo) - set(names))
    if unknown:
        raise WorkloadError(
            f"no SLO class {', '.join(map(repr, unknown))} in this workload; "
            f"its classes: {', '.join(names)}"
        )
    out = []
    for c in classes:
        ttft = ttft_slo.get(c.name)
        if ttft is not None and ttft > c.e2e_s:
            raise WorkloadError(
                f"{c.name}: {ttft:g} s is longer than the class's end-to-end SLO ({c.e2e_s:g} s)"
            )
        out.append(c if ttft is None else replace(c, ttft_s=ttft))
    return tuple(out)


def preset_spec(
    name: str,
    *,
    slo_scale: float = 1.0,
    interactive_share: float | None = None,
    tail_share: float | None = None,
    mega_share: float | None = None,
    max_tokens: int | None = None,
    ttft_slo: Mapping[str, float] | None = None,
    fleet_models: Sequence[str] | None = None,
) -> WorkloadSpec:
    """The ``WorkloadSpec`` of a named workload (``PRESETS``). SLOs in seconds, end to end.

    ``default``
        one model, ``llama-3-8b``; one class ``default``: 60 s, tier standard.
    ``wa`` (paper W_A, multi-model)
        models ``llama-3-8b`` 70 %, and three tail models (3 of 4 models, > 50 %) sharing
        ``tail_share`` = 30 % as 3:2:1: ``llama-2-7b`` 15 %, ``llama-2-13b`` 10 %,
        ``llama-2-70b`` 5 % (head-heavy, Zipf-like); classes ``interactive`` 20 s, tier interactive, 50 % and
        ``batch`` 300 s, tier batch, 50 %.
    ``wb`` (paper W_B, single model)
        ``llama-3-8b``; classes ``interactive`` 20 s 40 %, ``standard`` 60 s 30 %, ``batch``
        300 s 30 %, each with the tier of its name.
    ``wc`` (paper W_C, mega prompts)
        ``wa`` plus ``mega_share`` = 1 % extra mega prompts (input 3/4 and output 1/4 of the model's
        context: 6144 + 2048 tokens for llama-3-8b, 3072 + 1024 for llama-2), class ``batch``.

    Why these values: the paper gives latency-sensitive services an SLO under 30 s and batch jobs
    several minutes (§8); 20 s leaves room for a p99 Azure-conv answer (~600 tokens) at ~25 ms per
    token, and 300 s is "several minutes". ``slo_scale`` multiplies every SLO (Appendix A.1 sweeps it
    from 1 to 11). ``interactive_share`` sets the interactive class's share and rescales the others
    (paper Figs. 9 and 12 sweep it); ``tail_share`` sets the tail models' total share (Fig. 8).
    ``ttft_slo`` gives SLO classes a time-to-first-token SLO, in seconds by class name (scaled
    by ``slo_scale`` like every SLO); none of the presets has one otherwise. ``fleet_models``:
    the models the fleet serves; when it does not serve ``llama-3-8b``, the single-model presets
    (``default``, ``wb``) send their requests to the fleet's models instead, in equal shares.
    """
    if name not in PRESETS:
        raise WorkloadError(f"unknown workload {name!r}; known: {', '.join(PRESETS)}")
    if tail_share is not None and name not in ("wa", "wc"):
        raise WorkloadError(f"tail_share applies to wa and wc only, not {name!r}")
    if mega_share is not None and name != "wc":
        raise WorkloadError(f"mega_share applies to wc only, not {name!r}")
    interactive = SLOClass("interactive", INTERACTIVE_E2E_S, Tier.INTERACTIVE, 0.5)
    batch = SLOClass("batch", BATCH_E2E_S, Tier.BATCH, 0.5)
    single = _single_model()
    if fleet_models and single[0].name not in fleet_models:
        served = list(dict.fromkeys(fleet_models))
        single = tuple(ModelShare(m, 1 / len(served), model_context(m)) for m in served)
    if name == "default":
        models = single
        classes: tuple[SLOClass, ...] = (SLOClass("default", STANDARD_E2E_S, Tier.STANDARD, 1.0),)
    elif name == "wb":
        models = single
        classes = (
            replace(interactive, share=0.4),
            SLOClass("standard", STANDARD_E2E_S, Tier.STANDARD, 0.3),
            replace(batch, share=0.3),
        )
    else:
        models = _wa_models(0.3 if tail_share is None else tail_share)
        classes = (interactive, batch)
    mega = None
    if name == "wc":
        mega = MegaPrompts(share=0.01 if mega_share is None else mega_share, slo_class="batch")
    return WorkloadSpec(
        name=name,
        models=models,
        slo_classes=with_ttft(_with_interactive_share(classes, interactive_share), ttft_slo),
        slo_scale=slo_scale,
        max_tokens=max_tokens,
        mega=mega,
    )


def create_workload(
    name: str,
    trace: Trace,
    *,
    seed: int = 0,
    slo_scale: float = 1.0,
    interactive_share: float | None = None,
    tail_share: float | None = None,
    mega_share: float | None = None,
    max_tokens: int | None = None,
    ttft_slo: Mapping[str, float] | None = None,
    fleet_models: Sequence[str] | None = None,
) -> list[Request]:
    """The requests of a named workload (``preset_spec`` lists the rules) over ``trace``."""
    spec = preset_spec(
        name,
        slo_scale=slo_scale,
        interactive_share=interactive_share,
        tail_share=tail_share,
        mega_share=mega_share,
        max_tokens=max_tokens,
        ttft_slo=ttft_slo,
        fleet_models=fleet_models,
    )
    return build_requests(trace, spec, seed=seed)


def repeated(base: Sequence[Request], count: int, now: float, tag: str = "") -> list[Request]:
    """``count`` requests of ``base`` in turn (repeated with fresh ids: ``tag``, the round, the
    original id), arrived uniformly over the minute before ``now``: a backlog of a workload's
    requests as a controller would find it (the overhead experiment and benchmark)."""
    return [
        replace(
            base[k % len(base)],
            id=f"{tag}{k // len(base)}-{base[k % len(base)].id}",
            arrival_s=now - 60.0 + 60.0 * k / count,
        )
        for k in range(count)
    ]
