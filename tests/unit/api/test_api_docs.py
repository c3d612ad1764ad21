"""``/docs`` and ``/redoc`` work without internet access: every address their pages load is the
API's own, answers without a key, and is the JavaScript, CSS or icon the page expects."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.unit.api.test_api import Harness, run

_ADDRESS = re.compile(r'(?:src|href|spec-url)="([^"]*)"' + r"|url: '([^']*)'")
"""What a page loads: scripts, style sheets and icons, and the schema Swagger UI or ReDoc
fetches."""

KINDS = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "json"}


def loaded(page: str) -> list[str]:
    return [next(filter(None, m.groups())) for m in _ADDRESS.finditer(page)]


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (
            "/docs",
            {
                "/docs-assets/swagger-ui-bundle.js",
                "/docs-assets/swagger-ui.css",
                "/docs-assets/favicon.png",
                "/openapi.json",
            },
        ),
        (
            "/redoc",
            {"/docs-assets/redoc.standalone.js", "/docs-assets/favicon.png", "/openapi.json"},
        ),
    ],
)
def test_a_docs_page_loads_only_the_apis_own_files(page: str, expected: set[str]) -> None:
    async def scenario(h: Harness) -> None:
        response = await h.client.get(page)  # no key: a browser has none
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        html = response.text
        assert set(loaded(html)) == expected, loaded(html)
        assert "http://" not in html and "https://" not in html and "//cdn" not in html
        for address in expected:
            answer = await h.client.get(address)
            assert answer.status_code == 200, address
            kind = KINDS[address[address.rindex(".") :]]
            assert kind in answer.headers["content-type"], (address, answer.headers)
            assert len(answer.content) > 1000, address  # the bundle itself, not an error

    run(scenario)


def test_the_pages_follow_the_root_path_of_a_proxy() -> None:
    async def scenario(h: Harness) -> None:
        transport = httpx.ASGITransport(app=h.app, root_path="/qlm")
        async with httpx.AsyncClient(transport=transport, base_url="http://qlm") as client:
            html = (await client.get("/docs")).text
        assert set(loaded(html)) == {
            "/qlm/docs-assets/swagger-ui-bundle.js",
            "/qlm/docs-assets/swagger-ui.css",
            "/qlm/docs-assets/favicon.png",
            "/qlm/openapi.json",
        }

    run(scenario)
