"""The one path every submission takes, whichever endpoint it came through (native or
OpenAI-compatible): check the limits, ask the plan whether the SLO can be met, then hand the
request to the ``Submitter`` (store, then broker confirm).

Checks run cheapest first and each refusal names its limit: the request itself (422, 404 for an
unknown model), the tenant's rate (429), its queued requests (429), the plan (503 when
``QLM_API__ADMISSION=reject``). Nothing is recorded before all of them passed.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qlm import tracing
from qlm.api.auth import Principal
from qlm.api.context import ApiContext
from qlm.api.control import Verdict, assess
from qlm.api.errors import CONFLICT, NOT_FOUND, RATE_LIMIT, ApiError, invalid, unavailable
from qlm.api.limits import retry_after
from qlm.api.prompts import estimate_tokens, render_chat
from qlm.api.schemas.common import tier_of
from qlm.api.submission import Accepted, IdempotencyConflict
from qlm.domain import Tier
from qlm.frozen import fast_init
from qlm.global_queue import QueuedRequest
from qlm.store import NewRequest


@fast_init
@dataclass(frozen=True, slots=True)
class Submission:
    """A request as a client asked for it, before any limit was checked. ``prompt_param`` is the
    body field that holds the input (for errors): ``prompt`` or ``messages``."""

    model: str
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    slo_s: float | None = None
    ttft_slo_s: float | None = None
    tier: Tier | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    slo_param: str = "slo_seconds"
    ttft_param: str = "ttft_slo_seconds"

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"


@fast_init
@dataclass(frozen=True, slots=True)
class Admitted:
    accepted: Accepted
    verdict: Verdict


_IDS = random.Random(secrets.randbits(128))


def new_id() -> str:
    """A request id: ``req_`` and 24 random hex digits (96 bits), from a PRNG seeded by the OS.
    Ids need to be unique, not secret (another tenant's id answers 404 anyway), and
    ``os.urandom`` releases the GIL, which under load costs a wait for the store's thread."""
    return "req_" + _IDS.getrandbits(96).to_bytes(12).hex()  # 24 hex digits, as ``:024x``


def default_slo(ctx: ApiContext, tier: Tier) -> float:
    s = ctx.settings
    if tier == Tier.INTERACTIVE:
        return s.interactive_slo_s
    if tier == Tier.STANDARD:
        return s.standard_slo_s
    if tier == Tier.BATCH:
        return s.batch_slo_s
    raise KeyError(tier)


async def admit(
    ctx: ApiContext,
    principal: Principal,
    submission: Submission,
    idempotency_key: str | None,
) -> Admitted:
    """Check, record and publish ``submission`` for ``principal`` (module docstring)."""
    s = ctx.settings
    sub = submission
    if sub.prompt is None and sub.messages is None:
        raise invalid("prompt", "give either prompt or messages", code="missing_input")
    if sub.prompt is not None and sub.messages is not None:
        raise invalid("messages", "give either prompt or messages, not both", code="both_inputs")
    if sub.max_tokens > s.max_tokens_limit:
        raise invalid(
            "max_tokens",
            f"max_tokens is {sub.max_tokens}, above the limit of {s.max_tokens_limit} "
            "(QLM_API__MAX_TOKENS_LIMIT)",
            code="max_tokens_limit",
        )
    text = sub.prompt if sub.prompt is not None else render_chat(sub.messages or [])
    if sub.sampling.get("tools"):  # the chat template writes the tools into the prompt
        text += json.dumps(sub.sampling["tools"], separators=(",", ":"))
    prompt_tokens = estimate_tokens(text)
    if prompt_tokens > s.max_prompt_tokens:
        raise invalid(
            sub.prompt_param,
            f"the prompt is about {prompt_tokens} tokens, above the limit of "
            f"{s.max_prompt_tokens} (QLM_API__MAX_PROMPT_TOKENS)",
            code="max_prompt_tokens",
        )
    if len(sub.labels) > s.max_labels:
        raise invalid(
            "labels",
            f"{len(sub.labels)} labels, above the limit of {s.max_labels} (QLM_API__MAX_LABELS)",
            code="max_labels",
        )
    tier = sub.tier if sub.tier is not None else tier_of(s.default_tier)
    slo_s = sub.slo_s if sub.slo_s is not None else default_slo(ctx, tier)
    if sub.ttft_slo_s is not None and sub.ttft_slo_s > slo_s:
        raise invalid(
            sub.ttft_param,
            f"the TTFT deadline ({sub.ttft_slo_s:g} s) exceeds the end-to-end deadline "
            f"({slo_s:g} s)",
            code="ttft_after_deadline",
        )
    models = await ctx.control.models()
    if not models:
        raise unavailable(
            "no serving instance is known yet (is a controller running?)",
            code="no_instances",
            retry_after_s=5,
        )
    if sub.model not in models:
        raise ApiError(
            404,
            f"model {sub.model!r} is not served; served: {', '.join(sorted(models))}",
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )

    tenant = principal.tenant
    wait_s = ctx.limiter.take(tenant)
    if wait_s > 0:
        ctx.count(tenant, "rate_limited")
        raise ApiError(
            429,
            f"tenant {tenant!r} is over its rate of {s.rate_per_s:g} requests/s "
            f"(burst {s.rate_burst}; QLM_API__RATE_PER_S, QLM_API__RATE_BURST, per API replica)",
            type=RATE_LIMIT,
            code="rate_limit",
            headers={"Retry-After": retry_after(wait_s)},
        )
    if not await ctx.queued.reserve(tenant, s.max_queued_per_tenant):
        ctx.count(tenant, "queue_full")
        raise ApiError(
            429,
            f"tenant {tenant!r} has {s.max_queued_per_tenant} requests queued, the limit "
            "(QLM_API__MAX_QUEUED_PER_TENANT)",
            type=RATE_LIMIT,
            code="max_queued_per_tenant",
            headers={"Retry-After": "1"},
        )
    try:
        now = ctx.clock()
        snapshot = await ctx.control.snapshot()
        verdict = assess(snapshot, model=sub.model, deadline_at=now + slo_s, now=now)
        if not verdict.feasible and s.admission == "reject":
            ctx.count(tenant, "infeasible")
            raise unavailable(
                f"the SLO of {slo_s:g} s cannot be met: {verdict.reason} "
                "(QLM_API__ADMISSION=reject)",
                code="slo_infeasible",
                retry_after_s=max(1, round(min(60.0, slo_s))),
            )
        request_id = new_id()
        sampling = dict(sub.sampling)
        labels = dict(sub.labels)
        new = NewRequest(
            id=request_id,
            tenant=tenant,
            model=sub.model,
            prompt_tokens=prompt_tokens,
            max_tokens=sub.max_tokens,
            slo_e2e_s=slo_s,
            slo_ttft_s=sub.ttft_slo_s,
            submitted_at=now,
            tier=tier,
            prompt=sub.prompt,
            messages=sub.messages,
            sampling=sampling,
            labels=tuple(sorted(labels.items()) if len(labels) > 1 else labels.items()),
            idempotency_key=idempotency_key,
        )
        accept = None
        if tracing.enabled():  # off, there is no span and no trace context to make
            accept = tracing.start(
                "qlm.api.accept",
                kind="producer",
                attributes={
                    "qlm.request.id": request_id,
                    "qlm.tenant": tenant,
                    "qlm.model": sub.model,
                    "qlm.tier": int(tier),
                    "qlm.slo_seconds": slo_s,
                },
            )
        message = QueuedRequest(
            id=request_id,
            model=sub.model,
            prompt_tokens=prompt_tokens,
            max_tokens=sub.max_tokens,
            slo_e2e_s=slo_s,
            slo_ttft_s=sub.ttft_slo_s,
            submitted_at=now,
            tenant=tenant,
            prompt=text if sub.messages is not None else sub.prompt,
            messages=sub.messages,
            sampling=sampling,
            tier=int(tier),
            labels=labels,
            trace={} if accept is None else tracing.inject(accept),
        )
        try:
            accepted = await ctx.submitter.submit(new, message)
        except BaseException as exc:  # not accepted: the span says why
            tracing.end(accept, error=f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, IdempotencyConflict):
                raise
            raise ApiError(
                409,
                f"Idempotency-Key {idempotency_key!r} was used for a different request "
                f"({exc.existing.id}); use a new key for a new request",
                type=CONFLICT,
                param="Idempotency-Key",
                code="idempotency_key_reused",
            ) from None
        if accept is not None:
            tracing.end(accept, {"qlm.replayed": accepted.replayed})
    except BaseException:
        ctx.queued.release(tenant)
        raise
    if accepted.replayed:
        ctx.queued.release(tenant)
        ctx.count(tenant, "replayed")
    else:
        ctx.count(tenant, "accepted")
        if not verdict.feasible:
            ctx.count(tenant, "accepted_at_risk")
            ctx.at_risk.add(request_id, verdict.predicted_start_at)
    return Admitted(accepted, verdict)
