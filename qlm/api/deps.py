"""Dependencies of the routes, as ``Annotated`` aliases: the app context, the caller, admins."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from qlm.api.auth import Principal, require_admin
from qlm.api.context import ApiContext

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="An API key from `qlm keys create`: `Authorization: Bearer qlm_...`.",
)


async def get_context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[ApiContext, Depends(get_context)]


async def get_principal(
    ctx: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    return await ctx.auth.authenticate(credentials.credentials if credentials else None)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_admin(principal: PrincipalDep) -> Principal:
    return require_admin(principal)


AdminDep = Annotated[Principal, Depends(get_admin)]
