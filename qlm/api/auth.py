"""Who is calling: ``Authorization: Bearer <key>`` names a tenant (and whether it is an admin).

Keys are looked up in the store by digest (``qlm.store.keys``); a found key is trusted for
``QLM_API__KEY_CACHE_S`` seconds without asking again, which keeps the store out of the hot path
at thousands of calls per second and makes a revocation take effect within that time. Unknown
keys are not cached (a key created a moment ago works at once).

With ``QLM_API__REQUIRE_KEYS=false`` a call without a key acts as ``QLM_API__DEFAULT_TENANT``
with admin rights: for a trusted network or a demo only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from qlm.api.errors import AUTHENTICATION, PERMISSION, ApiError
from qlm.api.threads import StoreThreads
from qlm.frozen import fast_init
from qlm.settings import ApiSettings
from qlm.store import ApiKey, Store

_MAX_CACHED = 10_000
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@fast_init
@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: its tenant, whether it is an admin, and the key (None: no keys required)."""

    tenant: str
    admin: bool
    key_id: int | None = None


class Authenticator:
    def __init__(
        self,
        store: Store,
        settings: ApiSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        threads: StoreThreads | None = None,
    ) -> None:
        self._store = store
        self._threads = threads if threads is not None else StoreThreads()
        self._settings = settings
        self._clock = clock
        self._cache: dict[str, tuple[Principal, float]] = {}  # a found key's, until when
        self._looking_up: dict[str, asyncio.Task[ApiKey | None]] = {}
        self._anonymous = Principal(settings.default_tenant, admin=True)

    async def authenticate(self, token: str | None) -> Principal:
        """The principal of bearer ``token``; ``ApiError`` 401 when it is missing or unknown."""
        if not token:
            if not self._settings.require_keys:
                return self._anonymous
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' (qlm keys create)",
                type=AUTHENTICATION,
                param="Authorization",
                code="missing_api_key",
                headers=_CHALLENGE,
            )
        now = self._clock()
        cached = self._cache.get(token)
        if cached is not None and cached[1] > now:
            return cached[0]
        key = await self._lookup(token, now)
        if key is None:
            raise ApiError(
                401,
                "unknown or revoked API key",
                type=AUTHENTICATION,
                param="Authorization",
                code="invalid_api_key",
                headers=_CHALLENGE,
            )
        return Principal(key.tenant, key.admin, key.id)

    async def _lookup(self, token: str, now: float) -> ApiKey | None:
        """Ask the store once for all the calls that find the same key uncached at once (under
        load: every call in flight when its cache entry expires). The lookup is a task of its
        own, so a caller that goes away does not cancel it for the others."""
        task = self._looking_up.get(token)
        if task is None:
            task = asyncio.create_task(self._fetch(token, now), name="qlm-api-key-lookup")
            self._looking_up[token] = task
            task.add_done_callback(lambda done: self._lookup_done(token, done))
        return await asyncio.shield(task)

    async def _fetch(self, token: str, now: float) -> ApiKey | None:
        key = await self._threads.run(self._store.lookup_api_key, token)
        if key is not None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            principal = Principal(key.tenant, key.admin, key.id)
            self._cache[token] = (principal, now + self._settings.key_cache_s)
        else:
            self._cache.pop(token, None)
        return key

    def _lookup_done(self, token: str, task: asyncio.Task[ApiKey | None]) -> None:
        self._looking_up.pop(token, None)
        if not task.cancelled():
            task.exception()  # retrieved: the callers re-raise it


def require_admin(principal: Principal) -> Principal:
    if not principal.admin:
        raise ApiError(
            403,
            "this endpoint needs an admin key (qlm keys create --admin)",
            type=PERMISSION,
            param="Authorization",
            code="admin_required",
        )
    return principal
