"""Probes and metrics: ``/healthz`` (the process answers), ``/readyz`` (broker, store and a
controller reachable: route traffic here), ``/metrics`` (Prometheus).

The probes need no key, so that a load balancer or an orchestrator can call them; they say only
which part is down. ``/metrics`` needs an admin key unless ``QLM_API__METRICS_PUBLIC=true``.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from qlm.api import metrics
from qlm.api.auth import require_admin
from qlm.api.context import ApiContext
from qlm.api.deps import ContextDep, bearer
from qlm.api.errors import UNAVAILABLE, ErrorDetail, documented
from qlm.api.schemas.operator import CheckOut, HealthOut, ReadyOut
from qlm.store import StoreError

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, summary="Liveness")
async def healthz() -> HealthOut:
    """The process is up and serving HTTP."""
    return HealthOut()


async def readiness(ctx: ApiContext) -> dict[str, CheckOut]:
    """Each dependency's check: the broker takes messages, the store answers, a controller
    published its state within ``QLM_API__CONTROLLER_STALE_S`` (or runs in this process)."""
    broker_ok = await metrics.broker_up(ctx.queue)
    checks = {"broker": CheckOut(ok=broker_ok, detail="ok" if broker_ok else "unreachable")}
    try:
        states = await ctx.threads.run(ctx.store.controller_states)
    except StoreError as exc:
        checks["store"] = CheckOut(ok=False, detail=str(exc))
        checks["controller"] = CheckOut(ok=False, detail="unknown: the store is unreachable")
        return checks
    checks["store"] = CheckOut(ok=True, detail="ok")
    if ctx.controller is not None:
        checks["controller"] = CheckOut(ok=True, detail="in process")
        return checks
    stale_s = ctx.settings.controller_stale_s
    now = time.time()
    fresh = [s for s in states if s.active and now - s.updated_at <= stale_s]
    if fresh:
        checks["controller"] = CheckOut(ok=True, detail=f"{fresh[0].name} active")
    elif states:
        latest = states[0]
        checks["controller"] = CheckOut(
            ok=False,
            detail=f"no active controller published its state in the last {stale_s:g} s "
            f"(latest: {latest.name}, {now - latest.updated_at:.0f} s ago; "
            "QLM_API__CONTROLLER_STALE_S)",
        )
    else:
        checks["controller"] = CheckOut(ok=False, detail="no controller has published its state")
    return checks


class NotReadyOut(ReadyOut):
    """The checks, and the error every 4xx and 5xx answer carries."""

    error: ErrorDetail


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": NotReadyOut, "description": "Some dependency is down (named)."}},
    summary="Readiness",
)
async def readyz(ctx: ContextDep) -> JSONResponse:
    """200 when broker, store and controller are reachable, else 503 naming what is down. It
    recovers by itself: the broker client reconnects with back-off."""
    checks = await readiness(ctx)
    down = [name for name, check in checks.items() if not check.ok]
    if not down:
        body = ReadyOut(status="ready", checks=checks)
        return JSONResponse(body.model_dump(mode="json"))
    error = ErrorDetail(
        message="not ready: " + "; ".join(f"{name}: {checks[name].detail}" for name in down),
        type=UNAVAILABLE,
        code="not_ready",
    )
    not_ready = NotReadyOut(status="unavailable", checks=checks, error=error)
    return JSONResponse(not_ready.model_dump(mode="json"), status_code=503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {metrics.CONTENT_TYPE: {}}, "description": "Prometheus text format."},
        **documented(401, 403, 503),
    },
    summary="Prometheus metrics",
)
async def prometheus_metrics(
    ctx: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Response:
    if not ctx.settings.metrics_public:
        principal = await ctx.auth.authenticate(credentials.credentials if credentials else None)
        require_admin(principal)
    return Response(await metrics.render(ctx), media_type=metrics.CONTENT_TYPE)
