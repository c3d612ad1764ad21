"""API keys: how they are made and how the store recognises one without keeping it.

A key is ``qlm_`` followed by 32 random bytes (``secrets.token_urlsafe``, 43 characters, 256 bits).
The store keeps only its SHA-256 digest, unsalted, under a unique index:

- A salt defends against precomputed tables and a slow hash (scrypt, argon2) against guessing, both
  because human passwords have little entropy. A 256-bit random key has neither weakness: no table
  or guesser gets anywhere near it, so one SHA-256 is as strong as either.
- Without a per-row salt the digest is a pure function of the key, so ``lookup`` is one equality on
  an indexed column (O(1) per authenticated HTTP call), where a salted or slow hash would need a
  key id in the token and a deliberately costly hash on every call.
- The comparison happens in the database and is not constant-time, which leaks at most something
  about the digest; that does not help anyone construct a key whose digest matches.

A leaked database therefore yields no usable key. ``prefix`` (the first characters of the key,
``qlm_`` plus 8) is kept in clear so an operator can tell keys apart in a listing; it gives away
48 of the 256 bits.

``ApiKeys`` is the store's part that creates, looks up, revokes and lists them.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select, update

from qlm.store.base import StoreBase, _rowcount
from qlm.store.models import ApiKeyModel
from qlm.store.rows import ApiKey

KEY_PREFIX = "qlm_"
SHOWN_CHARS = len(KEY_PREFIX) + 8
_RANDOM_BYTES = 32
_KEY_CHARS = len(KEY_PREFIX) + 43  # token_urlsafe(32) is 43 characters, unpadded


def new_key() -> str:
    """A fresh API key. It is shown to its owner once and never stored."""
    return KEY_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)


def looks_like_key(key: str) -> bool:
    """A cheap shape check, so that garbage never reaches the database."""
    return len(key) == _KEY_CHARS and key.startswith(KEY_PREFIX)


def key_digest(key: str) -> str:
    """The stored form of a key: hex SHA-256 (see the module docstring for why it needs no salt)."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys(StoreBase):
    """The store's API keys, kept as their digests."""

    def create_api_key(self, tenant: str, *, admin: bool = False, name: str = "") -> str:
        """A new key for ``tenant``, returned in clear this once; only its digest is stored."""
        key = new_key()
        model = ApiKeyModel(
            tenant=tenant,
            name=name,
            prefix=key[:SHOWN_CHARS],
            key_hash=key_digest(key),
            admin=admin,
            created_at=self._clock(),
            revoked_at=None,
        )
        with self._tx(f"create an API key for {tenant!r}", write=True) as session:
            session.add(model)
        return key

    def lookup_api_key(self, key: str) -> ApiKey | None:
        """Who ``key`` belongs to; None when it is unknown, malformed or revoked."""
        if not looks_like_key(key):
            return None
        query = select(ApiKeyModel).where(
            ApiKeyModel.key_hash == key_digest(key), ApiKeyModel.revoked_at.is_(None)
        )
        with self._tx("look up an API key") as session:
            model = session.scalars(query).one_or_none()
            return None if model is None else _api_key(model)

    def revoke_api_key(self, key_id: int, *, at: float | None = None) -> bool:
        """Revoke key ``key_id`` (see ``api_keys``); False when unknown or already revoked."""
        stmt = (
            update(ApiKeyModel)
            .where(ApiKeyModel.id == key_id, ApiKeyModel.revoked_at.is_(None))
            .values(revoked_at=self._clock() if at is None else at)
        )
        with self._tx(f"revoke API key {key_id}", write=True) as session:
            return _rowcount(session.execute(stmt)) > 0

    def api_keys(self, *, tenant: str | None = None) -> list[ApiKey]:
        """Every key (revoked ones too), without secrets, oldest first."""
        query = select(ApiKeyModel).order_by(ApiKeyModel.id)
        if tenant is not None:
            query = query.where(ApiKeyModel.tenant == tenant)
        with self._tx("list API keys") as session:
            return [_api_key(m) for m in session.scalars(query)]


def _api_key(m: ApiKeyModel) -> ApiKey:
    return ApiKey(
        id=m.id,
        tenant=m.tenant,
        name=m.name,
        prefix=m.prefix,
        admin=m.admin,
        created_at=m.created_at,
        revoked_at=m.revoked_at,
    )
