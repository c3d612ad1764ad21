"""The operator API's bodies: virtual queues, groups, running requests, instances, plans,
controllers, SLO attainment and health."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qlm.api.schemas.common import StatusName, TierName, status_name, tier_name
from qlm.store import RequestRow


class GroupOut(BaseModel):
    """One request group in a virtual queue."""

    model_config = ConfigDict(extra="allow")

    id: str
    model: str
    size: int = Field(description="Requests in the group.")
    tier: str
    slo_class: str | None = None
    earliest_deadline_at: float | None = None
    latest_deadline_at: float | None = None
    predicted_completion_at: float | None = None
    p_meet_slo: float | None = Field(default=None, description="P(group meets its SLO).")
    at_risk: bool = Field(
        default=False, description="Predicted to miss its SLO (P(meet SLO) below the planner's Δ)."
    )
    deferred: bool = Field(
        default=False,
        description="The latest plan's cost-aware admission put it behind the others on its "
        "instance (served as capacity allows; counted in a plan's deferred, not its at_risk).",
    )
    missed: int | None = Field(
        default=None,
        description="Its requests already past their deadline when the state was published.",
    )
    tenants: dict[str, int] | None = Field(
        default=None, description="Its requests per tenant, most first."
    )
    instance: str | None = Field(default=None, description="The virtual queue holding it.")
    position: int | None = Field(default=None, description="0 = the head of its queue.")


class VirtualQueueOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    instance: str
    predicted_drain_at: float | None = None
    size: int = Field(description="Requests in the queue (the sum of its groups).")
    at_risk_requests: int = Field(
        description="Requests of its groups at risk now (missed ones included), every group in "
        "the queue counted, deferred ones too; a plan's at_risk lists groups instead."
    )
    missed_requests: int = Field(
        default=0, description="Requests already past their deadline (their groups are at risk)."
    )
    groups: list[GroupOut]


class QueuesOut(BaseModel):
    controller: str | None = Field(description="The controller that published this state.")
    at: float | None = Field(description="When it was published (unix seconds).")
    policy: str | None = None
    queues: list[VirtualQueueOut]


class GroupsOut(BaseModel):
    controller: str | None
    at: float | None
    data: list[GroupOut]


class RequestBriefOut(BaseModel):
    """A request as an operator scans it in a list: who, when due, where it is."""

    id: str
    tenant: str
    model: str
    tier: TierName
    status: StatusName
    submitted_at: float
    deadline_at: float
    dispatched_at: float | None
    first_token_at: float | None
    predicted_completion_at: float | None
    at_risk: bool = Field(description="Predicted to miss its deadline.")
    missed: bool = Field(
        description="Past its deadline and not final yet, or final without meeting its SLO."
    )
    instance: str | None
    tokens: int = Field(description="Output tokens generated so far (all of them once final).")
    evictions: int

    @classmethod
    def of(cls, row: RequestRow, now: float) -> RequestBriefOut:
        return cls(
            id=row.id,
            tenant=row.tenant,
            model=row.model,
            tier=tier_name(row.tier),
            status=status_name(row.status),
            submitted_at=row.submitted_at,
            deadline_at=row.deadline_at,
            dispatched_at=row.dispatched_at,
            first_token_at=row.first_token_at,
            predicted_completion_at=row.predicted_completion_at,
            at_risk=row.at_risk,
            missed=row.missed(now),
            instance=row.instance,
            tokens=row.output_tokens if row.is_final else row.partial_tokens,
            evictions=row.evictions,
        )


class GroupDetailOut(BaseModel):
    """One group and the requests it holds, as the controller last published them."""

    controller: str | None
    at: float | None = Field(description="When the state was published (unix seconds).")
    group: GroupOut
    requests: list[RequestBriefOut] = Field(
        description="Its requests in FCFS order (the first ``listed`` of them, as the store has them)."
    )
    listed: int = Field(
        description="How many of its requests the controller named: all of them unless its "
        "queues held more than 5,000 requests."
    )


class RunningOut(BaseModel):
    """The requests one instance runs."""

    instance: str
    max_running: int | None = Field(description="Its concurrency limit.")
    requests: list[RequestBriefOut]


class RunningListOut(BaseModel):
    controller: str | None
    at: float | None = Field(description="When the state was published (unix seconds).")
    data: list[RunningOut]


class InstanceOut(BaseModel):
    name: str
    url: str
    gpu: str
    gpu_count: int
    models: list[str]
    state: Literal["up", "down", "draining"] = Field(description="As recorded in the store.")
    tiers: dict[str, Literal["active", "warm", "cold"]] = Field(
        description="Where each model's weights are."
    )
    active_model: str | None = None
    outstanding: int | None = Field(default=None, description="Requests it runs now.")
    max_running: int | None = None
    up: bool | None = Field(default=None, description="The controller's latest health check.")
    updated_at: float


class InstancesOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[InstanceOut]


class PlanOut(BaseModel):
    """One planning event and why it happened."""

    id: int
    controller: str
    at: float
    trigger: str = Field(description="Why the planner ran (violation, instance change, ...).")
    groups: int = Field(
        description="Groups the plan ordered and placed (the deferred ones are not among them)."
    )
    status: str = Field(description="Solver status (optimal, timeout, infeasible, ...).")
    method: str = Field(description="milp, or the heuristic it fell back to.")
    objective: float = Field(description="Expected weighted SLO violation of the plan.")
    edf_objective: float = Field(description="The same for plain EDF: what planning gained.")
    at_risk: list[str] = Field(
        description="Planned groups the plan left below the chance constraint when it was made "
        "(expected to miss their SLO anyway); deferred groups are never listed."
    )
    capacity_needed: float | None = Field(
        description="Fleet multiple needed to meet every SLO (null: beyond what was searched)."
    )
    solve_s: float
    evaluations: int
    concurrency: dict[str, int]
    deferred: int = Field(
        default=0,
        description="Groups cost-aware admission put behind the others (served as capacity "
        "allows; not planned, not in at_risk).",
    )


class PlansOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[PlanOut]


ControllerRole = Literal["starting", "active", "standby", "stopping", "stopped"]


class ControllerOut(BaseModel):
    name: str
    role: ControllerRole = Field(
        description="starting: taking the global queue's leader lock (it does not know yet "
        "whether it leads); active: it leads and serves the queue; standby: another controller "
        "leads; stopping: it is stopping; stopped: it stopped cleanly. As it last published: "
        "see age_s."
    )
    active: bool = Field(description="It leads the global queue (role active).")
    updated_at: float
    age_s: float = Field(description="Seconds since it last published its state.")
    silent: bool = Field(
        default=False,
        description="It published nothing for longer than QLM_API__CONTROLLER_STALE_S and did "
        "not say it stopped: its role is what it was then (it may hang, or be dead).",
    )
    stopped_at: float | None = Field(
        default=None, description="When it stopped cleanly; null while it runs (or if it died)."
    )


class ControllersOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[ControllerOut]


class SloBucketOut(BaseModel):
    start: float = Field(description="Submitted at or after (unix seconds).")
    end: float = Field(description="Submitted before (unix seconds).")
    requests: int
    finished: int
    failed: int
    cancelled: int
    pending: int = Field(description="Not final yet: queued or running.")
    slo_met: int
    attainment: float | None = Field(
        description="slo_met / (finished + failed): failures count as misses, cancelled and "
        "pending requests are left out; null when none is decided."
    )


class AttainmentOut(BaseModel):
    object: Literal["list"] = "list"
    step: float = Field(description="Seconds per bucket (the last may be shorter).")
    data: list[SloBucketOut] = Field(description="Every bucket, oldest first, empty ones too.")


class CheckOut(BaseModel):
    ok: bool
    detail: str


class ReadyOut(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, CheckOut] = Field(description="broker, store, controller")


class HealthOut(BaseModel):
    status: Literal["ok"] = "ok"
