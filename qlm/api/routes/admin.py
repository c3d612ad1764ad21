"""Operator endpoints (admin keys only): the controller's virtual queues and groups (one group
with its requests and tenants), instances with their model tiers and load, the requests each
instance runs, plans and why they were made, drain/undrain, controllers, SLO attainment over
time."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Query

from qlm.api.context import ApiContext
from qlm.api.control import SnapshotDoc
from qlm.api.deps import AdminDep, ContextDep
from qlm.api.errors import documented, invalid, not_found
from qlm.api.schemas.common import NO_NUL, GroupIdPath, InstanceNamePath
from qlm.api.schemas.operator import (
    AttainmentOut,
    ControllerOut,
    ControllerRole,
    ControllersOut,
    GroupDetailOut,
    GroupOut,
    GroupsOut,
    InstanceOut,
    InstancesOut,
    PlanOut,
    PlansOut,
    QueuesOut,
    RequestBriefOut,
    RunningListOut,
    RunningOut,
    SloBucketOut,
    VirtualQueueOut,
)
from qlm.store import InstanceState, PlanRow, RequestRow
from qlm.store.requests import MAX_SERIES_BUCKETS

router = APIRouter(prefix="/v1/admin", tags=["admin"])

_ERRORS = documented(401, 403, 503)


def _groups(queue: Mapping[str, Any]) -> list[GroupOut]:
    out = []
    for position, group in enumerate(queue.get("groups") or []):
        # Request ids stay out of lists: ``GET /v1/admin/groups/{id}`` shows them, with the rows.
        fields = {
            k: v for k, v in group.items() if k not in ("instance", "position", "request_ids")
        }
        out.append(
            GroupOut.model_validate(
                {**fields, "instance": queue.get("instance"), "position": position}
            )
        )
    return out


def _queues(doc: SnapshotDoc | None) -> list[VirtualQueueOut]:
    queues = []
    for queue in (doc or {}).get("queues") or []:
        groups = _groups(queue)
        queues.append(
            VirtualQueueOut(
                instance=str(queue.get("instance")),
                predicted_drain_at=queue.get("predicted_drain_at"),
                size=sum(g.size for g in groups),
                at_risk_requests=sum(g.size for g in groups if g.at_risk),
                missed_requests=sum(g.missed or 0 for g in groups),
                groups=groups,
            )
        )
    return queues


@router.get("/queues", response_model=QueuesOut, responses=_ERRORS, summary="Virtual queues")
async def virtual_queues(ctx: ContextDep, _admin: AdminDep) -> QueuesOut:
    """Each instance's virtual queue in plan order: its groups with model, size, tier, earliest
    deadline, predicted completion, probability of meeting the SLO and risk."""
    doc = await ctx.control.snapshot()
    return QueuesOut(
        controller=(doc or {}).get("controller"),
        at=(doc or {}).get("at"),
        policy=(doc or {}).get("policy"),
        queues=_queues(doc),
    )


@router.get("/groups", response_model=GroupsOut, responses=_ERRORS, summary="Request groups")
async def groups(
    ctx: ContextDep,
    _admin: AdminDep,
    at_risk: Annotated[bool | None, Query(description="Only groups at risk (or not).")] = None,
) -> GroupsOut:
    """Every request group across the virtual queues, most urgent deadline first."""
    doc = await ctx.control.snapshot()
    data = [g for q in _queues(doc) for g in q.groups]
    if at_risk is not None:
        data = [g for g in data if g.at_risk is at_risk]
    data.sort(key=lambda g: (g.earliest_deadline_at is None, g.earliest_deadline_at or 0.0))
    return GroupsOut(controller=(doc or {}).get("controller"), at=(doc or {}).get("at"), data=data)


@router.get(
    "/groups/{group_id}",
    response_model=GroupDetailOut,
    responses=documented(401, 403, 404, 503),
    summary="One request group",
)
async def group(group_id: GroupIdPath, ctx: ContextDep, _admin: AdminDep) -> GroupDetailOut:
    """A group where its virtual queue holds it, its requests per tenant and its requests in
    FCFS order with their deadlines, status and predictions (the controller names every
    request of every group while its queues hold at most 5,000; beyond, each group's first
    ones: ``listed``). 404 for a group the controller's latest state does not hold (it was
    served, or re-clustered into others)."""
    doc = await ctx.control.snapshot()
    for queue in (doc or {}).get("queues") or []:
        for found in _groups(queue):
            if found.id != group_id:
                continue
            raw = (queue.get("groups") or [])[found.position or 0]
            ids = [str(i) for i in raw.get("request_ids") or []]
            rows = await ctx.threads.run(ctx.store.get_many, ids)
            at = (doc or {}).get("at")
            now = at if isinstance(at, int | float) else ctx.clock()
            return GroupDetailOut(
                controller=(doc or {}).get("controller"),
                at=at,
                group=found,
                requests=[RequestBriefOut.of(r, now) for r in rows],
                listed=len(ids),
            )
    raise not_found(f"group {group_id!r}", "group_id", code="group_not_found")


@router.get(
    "/running", response_model=RunningListOut, responses=documented(401, 403, 404, 503),
    summary="Running requests",
)  # fmt: skip
async def running(
    ctx: ContextDep,
    _admin: AdminDep,
    instance: Annotated[
        str | None, Query(max_length=256, description="Only this instance's.")
    ] = None,
) -> RunningListOut:
    """The requests each instance runs (sent to it and not back yet), as the controller last
    published them, with their tenant, deadline, tokens so far and whether they are past
    their deadline. 404 for an instance the controller does not know."""
    doc = await ctx.control.snapshot()
    states = [i for i in (doc or {}).get("instances") or [] if isinstance(i, dict)]
    if instance is not None:
        states = [i for i in states if i.get("name") == instance]
        if not states:
            raise not_found(f"instance {instance!r}", "instance", code="instance_not_found")
    ids = [str(rid) for i in states for rid in i.get("running") or []]
    rows = {r.id: r for r in await ctx.threads.run(ctx.store.get_many, ids)}
    at = (doc or {}).get("at")
    now = at if isinstance(at, int | float) else ctx.clock()
    data = [
        RunningOut(
            instance=str(i.get("name")),
            max_running=i.get("max_running"),
            requests=[
                _running(rows[str(rid)], now, (i.get("tokens") or {}).get(str(rid)))
                for rid in i.get("running") or []
                if str(rid) in rows
            ],
        )
        for i in states
    ]
    return RunningListOut(controller=(doc or {}).get("controller"), at=at, data=data)


def _running(row: RequestRow, now: float, tokens: object) -> RequestBriefOut:
    """A running request with the output tokens the controller counts for it now (the
    store's count moves only when it ends or is evicted)."""
    brief = RequestBriefOut.of(row, now)
    if isinstance(tokens, int) and not row.is_final:
        brief.tokens = max(tokens, brief.tokens)
    return brief


@router.get("/instances", response_model=InstancesOut, responses=_ERRORS, summary="Instances")
async def instances(ctx: ContextDep, _admin: AdminDep) -> InstancesOut:
    """Every known instance: its state (up, down, draining), where each model's weights are
    (active, warm, cold) and its load, as the controller last saw them."""
    return InstancesOut(data=await _instances(ctx))


async def _instances(ctx: ApiContext) -> list[InstanceOut]:
    rows = await ctx.threads.run(ctx.store.instances)
    doc = await ctx.control.snapshot()
    live = {i.get("name"): i for i in (doc or {}).get("instances") or []}
    data = []
    for row in rows:
        seen = live.get(row.name, {})
        tiers = seen.get("tiers") or {m: t.name.lower() for m, t in row.model_tiers.items()}
        data.append(
            InstanceOut(
                name=row.name,
                url=row.url,
                gpu=row.gpu,
                gpu_count=row.gpu_count,
                models=list(row.models),
                state=row.state.value,
                tiers=tiers,
                active_model=seen.get("active_model"),
                outstanding=seen.get("outstanding"),
                max_running=seen.get("max_running"),
                up=seen.get("up"),
                updated_at=row.updated_at,
            )
        )
    return data


async def _set_state(ctx: ApiContext, name: str, state: InstanceState) -> InstanceOut:
    if not await ctx.threads.run(ctx.store.set_instance_state, name, state):
        raise not_found(f"instance {name!r}", "name", code="instance_not_found")
    found = [i for i in await _instances(ctx) if i.name == name]
    if not found:
        raise not_found(f"instance {name!r}", "name", code="instance_not_found")
    return found[0]


@router.post(
    "/instances/{name}/drain",
    response_model=InstanceOut,
    responses=documented(401, 403, 404, 503),
    summary="Drain an instance",
)
async def drain(name: InstanceNamePath, ctx: ContextDep, _admin: AdminDep) -> InstanceOut:
    """Stop pulling new work onto ``name``; what it runs finishes. The controller polls it."""
    return await _set_state(ctx, name, InstanceState.DRAINING)


@router.post(
    "/instances/{name}/undrain",
    response_model=InstanceOut,
    responses=documented(401, 403, 404, 503),
    summary="Undrain an instance",
)
async def undrain(name: InstanceNamePath, ctx: ContextDep, _admin: AdminDep) -> InstanceOut:
    """Let ``name`` take work again."""
    return await _set_state(ctx, name, InstanceState.UP)


def _plan(row: PlanRow) -> PlanOut:
    plan = row.plan
    return PlanOut(
        id=row.id,
        controller=row.controller,
        at=plan.at_s,
        trigger=plan.trigger,
        groups=plan.groups,
        status=plan.status,
        method=plan.method,
        objective=plan.objective,
        edf_objective=plan.edf_objective,
        at_risk=list(plan.at_risk),
        capacity_needed=plan.capacity_needed,
        solve_s=plan.solve_s,
        evaluations=plan.evaluations,
        concurrency=dict(plan.concurrency),
        deferred=plan.deferred,
    )


@router.get(
    "/plans/latest",
    response_model=PlanOut,
    responses=documented(401, 403, 404, 503),
    summary="The latest plan and why",
)
async def latest_plan(ctx: ContextDep, _admin: AdminDep) -> PlanOut:
    """What triggered it, how it was solved, its expected violation against EDF's, the groups
    left at risk and the capacity every SLO would need."""
    row = await ctx.threads.run(ctx.store.latest_plan)
    if row is None:
        raise not_found("plan", code="no_plan")
    return _plan(row)


@router.get("/plans", response_model=PlansOut, responses=_ERRORS, summary="Plan history")
async def plans(
    ctx: ContextDep,
    _admin: AdminDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="How many, newest first.")] = 50,
) -> PlansOut:
    rows = await ctx.threads.run(ctx.store.plans, limit=limit)
    return PlansOut(data=[_plan(r) for r in rows])


@router.get("/controllers", response_model=ControllersOut, responses=_ERRORS, summary="Controllers")
async def controllers(ctx: ContextDep, _admin: AdminDep) -> ControllersOut:
    """Each controller's last published state: its role (starting, active, standby, stopping,
    stopped), how fresh, and whether it has gone silent (``QLM_API__CONTROLLER_STALE_S``)."""
    rows = await ctx.threads.run(ctx.store.controller_states)
    now = time.time()
    stale_s = ctx.settings.controller_stale_s
    return ControllersOut(
        data=[
            ControllerOut(
                name=r.name,
                role=controller_role(r.active, r.stopped_at, r.snapshot),
                active=r.active,
                updated_at=r.updated_at,
                age_s=now - r.updated_at,
                silent=r.stopped_at is None and now - r.updated_at > stale_s,
                stopped_at=r.stopped_at,
            )
            for r in rows
        ]
    )


def controller_role(
    active: bool, stopped_at: float | None, snapshot: Mapping[str, Any]
) -> ControllerRole:
    """A controller's role from its published state: stopped once it said so, active while it
    says it leads, else the role it published (a state without one, from an older controller
    that published only whether it was active: standby)."""
    if stopped_at is not None:
        return "stopped"
    if active:
        return "active"
    role = snapshot.get("role")
    return role if role in ("starting", "standby", "stopping") else "standby"


@router.get(
    "/attainment",
    response_model=AttainmentOut,
    responses=documented(401, 403, 422, 503),
    summary="SLO attainment over time",
)
async def attainment(
    ctx: ContextDep,
    _admin: AdminDep,
    since: Annotated[float, Query(ge=0, le=1e11, description="Start (unix seconds).")],
    until: Annotated[float, Query(ge=0, le=1e11, description="End (unix seconds).")],
    step: Annotated[
        float,
        Query(
            ge=1,
            le=1e11,
            description=f"Seconds per bucket; at most {MAX_SERIES_BUCKETS} buckets in the span.",
        ),
    ] = 86400.0,
    tenant: Annotated[
        str | None,
        Query(
            max_length=256, description="Only this tenant's.", json_schema_extra={"pattern": NO_NUL}
        ),
    ] = None,
) -> AttainmentOut:
    """SLO attainment of the requests submitted in ``[since, until)``, in buckets of ``step``
    seconds from ``since``: what the nightly report's trend across days reads, from the store
    (its retention, ``QLM_CONTROLLER__RETAIN_DAYS``, bounds how far back)."""
    if until <= since:
        raise invalid(
            "until", f"until ({until:g}) must be after since ({since:g})", code="empty_span"
        )
    if (until - since) / step > MAX_SERIES_BUCKETS:
        raise invalid(
            "step",
            f"{(until - since) / step:,.0f} buckets of {step:g} s: at most {MAX_SERIES_BUCKETS}",
            code="too_many_buckets",
        )
    if tenant is not None and "\x00" in tenant:
        raise invalid("tenant", "tenant must not contain the NUL character", code="nul_character")
    rows = await ctx.threads.run(
        ctx.store.slo_series, since=since, until=until, step=step, tenant=tenant
    )
    return AttainmentOut(
        step=step,
        data=[
            SloBucketOut(
                start=r.start,
                end=r.end,
                requests=r.requests,
                finished=r.finished,
                failed=r.failed,
                cancelled=r.cancelled,
                pending=r.pending,
                slo_met=r.slo_met,
                attainment=r.attainment,
            )
            for r in rows
        ],
    )
