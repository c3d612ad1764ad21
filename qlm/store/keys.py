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
"""

from __future__ import annotations

import hashlib
import secrets

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
