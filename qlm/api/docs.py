"""The API's documentation pages, ``/docs`` (Swagger UI) and ``/redoc``, with their JavaScript,
CSS and icon served by the API itself (under ``ASSETS``) from the ``fastapi-offline`` package.

FastAPI's own pages load them from a CDN, so on a host without internet access, as serving hosts
often are, ``/docs`` stays blank; and a browser that opens them fetches code from a third party.
``fastapi-offline`` ships the same Swagger UI 5 and ReDoc 2 bundles FastAPI's pages name; only
its files are used here, not its app factory. Nothing on the pages is fetched from elsewhere:
no online validator, no web fonts."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"
"""Where the pages' files are served (no key needed, as for the pages)."""

_PACKAGE = ("fastapi_offline", "static")


def install(app: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and their files on ``app`` (made with ``docs_url=None`` and
    ``redoc_url=None``). Addresses are under the app's ``root_path``, as behind a proxy that
    serves it under a prefix."""
    app.mount(ASSETS, StaticFiles(packages=[_PACKAGE]), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # else a badge from swagger.io
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
