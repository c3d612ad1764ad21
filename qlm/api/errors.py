"""Every error the API answers, in one shape (OpenAI's, so both APIs read alike):

    {"error": {"message": "...", "type": "...", "param": "max_tokens", "code": "..."}}

``param`` names the offending field, header or query parameter, and ``code`` the limit or rule
(e.g. ``max_tokens_limit``), so a client can tell what to change without parsing the message.
Route code raises ``ApiError``; the handlers here translate FastAPI's validation errors, Starlette's
404/405, and the store's and queue's errors (``StoreError``, ``QueueUnavailable``: 503) into it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from qlm.api.schemas.common import MAX_JSON_DEPTH
from qlm.global_queue import QueueUnavailable
from qlm.store import InvalidCursor, StoreError

log = logging.getLogger(__name__)

# ``type`` values, as OpenAI names them where it has a name.
INVALID = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
CONFLICT = "conflict_error"
RATE_LIMIT = "rate_limit_error"
TOO_LARGE = "request_too_large"
UNAVAILABLE = "service_unavailable"
TIMEOUT = "timeout_error"
UPSTREAM = "upstream_error"
INTERNAL = "internal_error"


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, naming the field or limit.")
    type: str = Field(description="Error class, e.g. invalid_request_error, rate_limit_error.")
    param: str | None = Field(
        default=None, description="The body field, header or query parameter at fault."
    )
    code: str = Field(
        description="The limit or rule that was broken, e.g. max_tokens_limit: always set, so a "
        "client can tell what to change without parsing the message."
    )


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


class ApiError(Exception):
    """An answer other than success: raised anywhere in a route, rendered by ``install``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.type, self.param, self.code, self.headers
        )


def error_response(
    status: int,
    message: str,
    type: str,
    param: str | None,
    code: str,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def invalid(param: str, message: str, *, code: str) -> ApiError:
    """A 422 naming ``param``."""
    return ApiError(422, message, type=INVALID, param=param, code=code)


def not_found(what: str, param: str | None = None, *, code: str) -> ApiError:
    return ApiError(404, f"{what} not found", type=NOT_FOUND, param=param, code=code)


def unavailable(message: str, *, code: str, retry_after_s: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, type=UNAVAILABLE, code=code, headers=headers)


# Which responses each kind of route documents (OpenAPI): the schema must hold for errors too.
def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "Malformed request",
        401: "Missing, unknown or revoked API key",
        403: "The key may not do this (admin keys only)",
        404: "No such resource for this tenant",
        409: "Conflicts with the resource's state",
        413: "Body larger than the limit",
        415: "The body is not JSON (Content-Type)",
        422: "A field, header or query parameter is invalid; `param` names it",
        429: "Rate or queued-request limit reached; see Retry-After",
        502: "The request failed on the serving instance",
        503: "Broker, store or controller unavailable, or the SLO cannot be met",
        504: "The result did not come in time",
    }
    # The schema is referenced rather than given as ``model``: FastAPI would file it under the
    # route's media type, which is text/event-stream for the streaming routes.
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    return {s: {"description": descriptions[s], "content": content} for s in statuses}


def error_schemas() -> dict[str, Any]:
    """``ErrorBody`` and ``ErrorDetail`` as OpenAPI components (``documented`` refers to them)."""
    schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions: dict[str, Any] = schema.pop("$defs", {})
    return {"ErrorBody": schema, **definitions}


def _param(loc: Sequence[int | str]) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; a header keeps its name."""
    parts = list(loc)
    if len(parts) >= 2 and parts[0] in ("query", "header", "path", "cookie"):
        return str(parts[1])  # a header's name (``x-qlm-tier``) as sent
    if parts and parts[0] == "body":
        parts = parts[1:]
    if not parts:
        return "body"
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier() or part in _TYPE_LABELS:
            break  # pydantic's label of a union's branch (``function-after[...]``, ``str``)
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def response_for(exc: Exception) -> JSONResponse | None:
    """The answer to an error a route raised on purpose (``ApiError``, ``StoreError``,
    ``QueueUnavailable``); None for anything else."""
    if isinstance(exc, ApiError):
        return exc.response()
    if isinstance(exc, InvalidCursor):
        return error_response(422, str(exc), INVALID, "cursor", "invalid_cursor")
    if isinstance(exc, StoreError):
        log.warning("store unavailable: %s", exc)
        return error_response(
            503, f"store unavailable: {exc}", UNAVAILABLE, None, code="store_unavailable"
        )
    if isinstance(exc, QueueUnavailable):
        log.warning("global queue unavailable: %s", exc)
        return error_response(
            503,
            f"global queue unavailable, nothing was accepted: {exc}",
            UNAVAILABLE,
            None,
            code="broker_unavailable",
            headers={"Retry-After": "1"},
        )
    return None


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: dict[str, Any] = (
        dict(errors[0]) if errors else {"loc": ("body",), "msg": "invalid", "type": ""}
    )
    param = _param(first.get("loc", ()))
    if tuple(first.get("loc", ()))[:1] == ("path",):
        return _invalid_id(param, first)
    message = f"{param}: {first.get('msg', 'invalid')}"
    if first.get("type") == "json_invalid":
        param, message = "body", f"body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_response(422, message, INVALID, param, str(first.get("type") or "invalid"))


_ID_PROBLEMS = {
    "string_too_short": "it is empty",
    "string_too_long": "it is longer than {max_length} characters",
    "string_pattern_mismatch": "it holds a character no id has (a control character such as "
    "NUL, or a slash)",
}


def _invalid_id(param: str, error: Mapping[str, Any]) -> JSONResponse:
    """A path parameter no request, instance or model can have
    (``qlm.api.schemas.common.ID_PATTERN``): refused before anything is looked up, so that such
    input never reaches the store."""
    template = _ID_PROBLEMS.get(str(error.get("type")))
    problem = template.format(**(error.get("ctx") or {})) if template else error.get("msg", "")
    return error_response(
        422, f"{param} is not a valid id: {problem}", INVALID, param, "invalid_id"
    )


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own errors: no route for the path (404), none for the method
    (405), a body FastAPI could not read (400)."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        return error_response(
            404,
            f"no endpoint {request.url.path} (the API's calls: /docs, /openapi.json)",
            NOT_FOUND,
            None,
            "unknown_endpoint",
        )
    if status == 405:
        allowed = allowed_methods(request)
        return error_response(
            405,
            f"{request.method} is not allowed on {request.url.path}; allowed: "
            f"{', '.join(allowed) or 'none'}",
            INVALID,
            None,
            "method_not_allowed",
            headers={"Allow": ", ".join(allowed)},
        )
    if status == 400:
        return _unreadable_body(exc.__cause__)
    types = {401: AUTHENTICATION, 403: PERMISSION}
    message = str(exc.detail) if exc.detail else f"HTTP {status}"
    return error_response(
        status, message, types.get(status, INVALID), None, f"http_{status}", headers=exc.headers
    )


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on the request's path (the ``Allow`` header of a 405).
    Starlette names only the methods of the first route whose path matched, so a path served
    by two routes (``GET`` and ``DELETE /v1/requests/{id}``) lost the other's."""
    routes = request.app.router.routes
    return [
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    ]


def _unreadable_body(cause: BaseException | None) -> JSONResponse:
    """FastAPI's 400 for a body it could not parse, with what was wrong (its message says only
    that there was an error)."""
    if isinstance(cause, UnicodeDecodeError):
        return error_response(
            422,
            f"body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at offset "
            f"{cause.start} ({cause.reason}); JSON bodies are UTF-8",
            INVALID,
            "body",
            "body_not_utf8",
        )
    if isinstance(cause, RecursionError):
        return error_response(
            422,
            f"body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            INVALID,
            "body",
            "json_too_deep",
        )
    return error_response(
        400, f"body could not be read: {cause!r}", INVALID, "body", "body_unreadable"
    )


async def _on_store(_request: Request, exc: Exception) -> JSONResponse:
    response = response_for(exc)
    assert isinstance(exc, StoreError) and response is not None
    return response


async def _on_queue(_request: Request, exc: Exception) -> JSONResponse:
    response = response_for(exc)
    assert isinstance(exc, QueueUnavailable) and response is not None
    return response


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return error_response(
        500, "internal error (logged by the server)", INTERNAL, None, "internal_error"
    )


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the one shape."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(StoreError, _on_store)
    app.add_exception_handler(QueueUnavailable, _on_queue)
    app.add_exception_handler(Exception, _on_unexpected)
