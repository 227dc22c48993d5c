"""Secret tokens: generated once, shown once, stored as SHA-256 hashes (they are random, so no salt or stretching)."""

from __future__ import annotations

import hashlib
import secrets


def new_token(prefix: str) -> str:
    """A fresh token such as `ast_dev_...`; the prefix tells a leaked token's kind at a glance."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
