"""What the API refuses at its edge, and how: ids in paths that no request can have, SLOs no
queue can plan for, bodies that cannot be read, and every other error in the one shape with a
code. In process (httpx over ASGI), on the harness of ``tests.unit.test_api``."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from qlm.store import Store, StoreError
from tests.unit.test_api import Harness, error, run


def refuse_nul_like_postgresql(store: Store) -> list[str]:
    """Make ``store`` answer a text argument holding NUL as PostgreSQL does (a ``StoreError``:
    text cannot hold it), and return the names of the store methods called with one."""
    asked: list[str] = []

    def wrap(name: str) -> None:
        method = getattr(store, name)

        @functools.wraps(method)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, str) and "\x00" in a for a in (*args, *kwargs.values())):
                asked.append(name)
                raise StoreError(f"cannot {name}: PostgreSQL text cannot contain NUL (0x00)")
            return method(*args, **kwargs)

        setattr(store, name, refusing)

    for name in ("get", "cancel", "set_instance_state", "instances"):
        wrap(name)
    return asked


PATHS_WITH_IDS = [
    ("GET", "/v1/requests/{}", "request_id"),
    ("GET", "/v1/requests/{}/events", "request_id"),
    ("DELETE", "/v1/requests/{}", "request_id"),
    ("POST", "/v1/admin/instances/{}/drain", "name"),
    ("POST", "/v1/admin/instances/{}/undrain", "name"),
    ("GET", "/v1/models/{}", "model"),
]


@pytest.mark.parametrize(("method", "path", "param"), PATHS_WITH_IDS)
@pytest.mark.parametrize("bad", ["req_%00x", "%00", "a%1fb", "x" * 257])
def test_an_id_no_request_can_have_is_refused_before_the_store_sees_it(
    method: str, path: str, param: str, bad: str
) -> None:
    async def scenario(h: Harness) -> None:
        asked = refuse_nul_like_postgresql(h.store)
        r = await h.client.request(method, path.format(bad), headers=h.auth("admin"))
        assert r.status_code == 422, r.text
        err = error(r)
        assert (err["param"], err["code"]) == (param, "invalid_id"), err
        assert f"{param} is not a valid id" in err["message"]
        assert asked == []

    run(scenario)


@pytest.mark.parametrize(("method", "path", "param"), PATHS_WITH_IDS)
def test_a_well_formed_unknown_id_is_404_naming_it(method: str, path: str, param: str) -> None:
    async def scenario(h: Harness) -> None:
        r = await h.client.request(
            method, path.format("req_0123 unknown é"), headers=h.auth("admin")
        )
        assert r.status_code == 404, r.text
        assert error(r)["code"] is not None

    run(scenario)
