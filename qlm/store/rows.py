"""What the store takes and returns: frozen dataclasses, never ORM objects, so a caller on any
thread can keep, compare and log them without a database session."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from qlm.domain import SLO, InstanceSpec, ModelTier, PlanRecord, Request, RequestStatus, Tier
from qlm.frozen import fast_init


class InstanceState(StrEnum):
    """Whether an instance takes work: ``draining`` finishes what it runs and pulls nothing new."""

    UP = "up"
    DOWN = "down"
    DRAINING = "draining"


@fast_init
@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request as the API accepted it, before anything happened to it.

    ``prompt`` or ``messages`` (chat) holds the input; ``sampling`` the engine parameters the
    control plane passes through untouched (temperature, stop, ...).
    """

    id: str
    tenant: str
    model: str
    prompt_tokens: int
    max_tokens: int
    slo_e2e_s: float
    submitted_at: float
    slo_ttft_s: float | None = None
    tier: Tier = Tier.STANDARD
    slo_class: str = "default"
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    labels: tuple[tuple[str, str], ...] = ()
    idempotency_key: str | None = None

    @classmethod
    def from_request(
        cls,
        request: Request,
        *,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> NewRequest:
        """The record of a domain ``Request`` (its arrival is the submission time)."""
        return cls(
            id=request.id,
            tenant=request.tenant,
            model=request.model,
            prompt_tokens=request.input_tokens,
            max_tokens=request.max_tokens,
            slo_e2e_s=request.slo.e2e_s,
            slo_ttft_s=request.slo.ttft_s,
            submitted_at=request.arrival_s,
            tier=request.tier,
            slo_class=request.slo_class,
            prompt=prompt,
            messages=messages,
            sampling=dict(sampling or {}),
            labels=request.labels,
            idempotency_key=idempotency_key,
        )

    def queued_row(self, updated_at: float) -> RequestRow:
        """The row the store holds right after recording this request (what a read would
        return), built without reading it back."""
        return RequestRow(
            id=self.id,
            tenant=self.tenant,
            model=self.model,
            slo_class=self.slo_class,
            prompt=self.prompt,
            messages=self.messages,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            sampling=dict(self.sampling),
            slo_e2e_s=self.slo_e2e_s,
            slo_ttft_s=self.slo_ttft_s,
            tier=self.tier,
            labels=self.labels,
            idempotency_key=self.idempotency_key,
            status=RequestStatus.QUEUED,
            cancel_requested=False,
            submitted_at=self.submitted_at,
            dispatched_at=None,
            first_token_at=None,
            finished_at=None,
            instance=None,
            output_text=None,
            output_tokens=0,
            output_tool_calls=None,
            partial_text="",
            partial_tokens=0,
            evictions=0,
            swaps=0,
            attempts=0,
            slo_met=None,
            ttft_met=None,
            error=None,
            predicted_completion_at=None,
            at_risk=False,
            updated_at=updated_at,
        )


@dataclass(frozen=True, slots=True)
class RequestRow:
    """Everything recorded about one request. Timestamps are unix epoch seconds."""

    id: str
    tenant: str
    model: str
    slo_class: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    prompt_tokens: int
    max_tokens: int
    sampling: Mapping[str, Any]
    slo_e2e_s: float
    slo_ttft_s: float | None
    tier: Tier
    labels: tuple[tuple[str, str], ...]
    idempotency_key: str | None
    status: RequestStatus
    cancel_requested: bool
    submitted_at: float
    dispatched_at: float | None
    first_token_at: float | None
    finished_at: float | None
    instance: str | None
    output_text: str | None
    output_tokens: int
    output_tool_calls: list[dict[str, Any]] | None  # the tools the answer called, if any
    partial_text: str  # output kept by an evicted or interrupted request, to resume from
    partial_tokens: int
    evictions: int
    swaps: int
    attempts: int  # times it was dispatched to an instance
    slo_met: bool | None
    ttft_met: bool | None
    error: str | None
    predicted_completion_at: float | None  # the estimator's latest prediction while it waits
    at_risk: bool
    updated_at: float

    @property
    def is_final(self) -> bool:
        return self.status.is_final

    @property
    def deadline_at(self) -> float:
        return self.submitted_at + self.slo_e2e_s

    def missed(self, now: float) -> bool:
        """Whether the request missed its deadline: a final one that did not meet its SLO, or one
        still queued or running at ``now``, past its deadline (not merely "at risk")."""
        return self.slo_met is False if self.is_final else now > self.deadline_at

    def to_request(self) -> Request:
        """The domain request, e.g. for a controller rebuilding its queues from the store."""
        return Request(
            id=self.id,
            model=self.model,
            input_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            arrival_s=self.submitted_at,
            slo=SLO(e2e_s=self.slo_e2e_s, ttft_s=self.slo_ttft_s),
            tier=self.tier,
            tenant=self.tenant,
            slo_class=self.slo_class,
            labels=self.labels,
        )


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    """How a request ended, as ``record_outcome_row`` recorded it, with the stored timestamps
    its latencies are measured from — the first dispatch, the first token ever — as the
    latency histograms measure them (``qlm.store.latency``)."""

    id: str
    tenant: str
    model: str
    tier: Tier
    status: RequestStatus
    submitted_at: float
    dispatched_at: float | None
    first_token_at: float | None
    finished_at: float
    instance: str | None
    output_tokens: int
    slo_met: bool | None  # as given: a finished request's verdict (None for the others)
    error: str | None
    ttft_met: bool | None = None  # as given: None without a first-token deadline or verdict

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.submitted_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_s(self) -> float | None:
        """Submission to the first dispatch to an instance: the wait in the queue."""
        return None if self.dispatched_at is None else self.dispatched_at - self.submitted_at


@dataclass(frozen=True, slots=True)
class InstanceRow:
    name: str
    url: str
    gpu: str
    gpu_count: int
    models: tuple[str, ...]
    state: InstanceState
    model_tiers: Mapping[str, ModelTier]
    updated_at: float

    @property
    def spec(self) -> InstanceSpec:
        return InstanceSpec(
            name=self.name, gpu=self.gpu, models=self.models, gpu_count=self.gpu_count, url=self.url
        )


@dataclass(frozen=True, slots=True)
class PlanRow:
    """A stored plan: the ``PlanRecord`` with its id (increasing) and the controller that made it."""

    id: int
    controller: str
    plan: PlanRecord


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key without its secret: who it belongs to and what it may do."""

    id: int
    tenant: str
    name: str
    prefix: str
    admin: bool
    created_at: float
    revoked_at: float | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class ControllerStateRow:
    """A controller's published state: ``snapshot`` is the JSON document of
    ``qlm.service.controller.ControllerService.snapshot`` (docs/operations.md)."""

    name: str
    active: bool
    updated_at: float
    snapshot: Mapping[str, Any]
    stopped_at: float | None = None  # when it stopped cleanly (None: running, or it died)


@dataclass(frozen=True, slots=True)
class LatencyBucketRow:
    """One stored bucket of a latency histogram (``qlm.store.latency``): ``count``
    observations fell in it — above the next lower bound, at most ``le`` — summing ``sum``
    seconds."""

    histogram: str
    tier: Tier
    model: str
    le: float
    count: int
    sum: float


def attainment(slo_met: int, finished: int, failed: int) -> float | None:
    """The share of the decided requests (finished or failed) that met their SLO; None when
    none was decided."""
    decided = finished + failed
    return slo_met / decided if decided else None


@dataclass(frozen=True, slots=True)
class SloSummaryRow:
    """SLO attainment of the requests of one group (a tenant, model or tier) submitted in a window.

    ``attainment`` counts a failed request as a miss and leaves out cancelled and unfinished
    ones: it is ``slo_met / (finished + failed)``, None when nothing was decided yet.
    """

    group: str
    requests: int
    finished: int
    failed: int
    cancelled: int
    pending: int
    slo_met: int

    @property
    def attainment(self) -> float | None:
        return attainment(self.slo_met, self.finished, self.failed)


@dataclass(frozen=True, slots=True)
class SloBucketRow:
    """SLO attainment of the requests submitted in ``[start, end)``, one bucket of a series
    (``Requests.slo_series``); what counts is as in ``SloSummaryRow``."""

    start: float
    end: float
    requests: int
    finished: int
    failed: int
    cancelled: int
    pending: int
    slo_met: int

    @property
    def attainment(self) -> float | None:
        return attainment(self.slo_met, self.finished, self.failed)
