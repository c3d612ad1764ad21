"""Dependencies of the routes, as ``Annotated`` aliases: the app context, the caller, admins."""

from __future__ import annotations

import email.message
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from qlm.api.auth import Principal, require_admin
from qlm.api.context import ApiContext
from qlm.api.errors import INVALID, ApiError

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


def is_json(content_type: str | None) -> bool:
    """``application/json`` or another JSON type (``application/*+json``), as FastAPI decides
    whether to parse a body as JSON."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def require_json(request: Request, _principal: PrincipalDep) -> None:
    """Refuse a body that is not JSON with 415 naming Content-Type (FastAPI would validate its
    bytes as the body and answer a 422 that the body is not an object). The caller is
    authenticated first, as for every other error."""
    content_type = request.headers.get("content-type")
    if is_json(content_type) or not await request.body():
        return
    raise ApiError(
        415,
        f"Content-Type is {content_type!r}: send the body as JSON, with "
        "Content-Type: application/json"
        if content_type
        else "no Content-Type: send the body as JSON, with Content-Type: application/json",
        type=INVALID,
        param="Content-Type",
        code="unsupported_media_type",
    )


JsonBodyDep = Depends(require_json)
