"""Parsing API key settings and headers: plain data, so reading settings loads no web framework."""

from __future__ import annotations

import re

# The tenant of a data key bound to none, and of the admin key used on the data API.
NO_TENANT = "default"
ADMIN_TENANT = "admin"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def keys_of(setting: str | None) -> tuple[bytes, ...]:
    """The keys a setting holds: none, one, or several separated by commas."""
    if not setting:
        return ()
    return tuple(k.strip().encode() for k in setting.split(",") if k.strip())


def tenant_keys(setting: str | None) -> tuple[tuple[bytes, str], ...]:
    """The (key, tenant) pairs of a data key setting: 'KEY' (tenant ``NO_TENANT``) or
    'TENANT:KEY', separated by commas. Raises ValueError for a bad tenant name or an
    empty key, naming the entry's position, never the key."""
    pairs: list[tuple[bytes, str]] = []
    for n, entry in enumerate(keys_of(setting), 1):
        tenant, sep, key = entry.partition(b":")
        if not sep:
            pairs.append((entry, NO_TENANT))
            continue
        name = tenant.decode("latin-1").strip()
        if not _TENANT.fullmatch(name) or not key.strip():
            raise ValueError(
                f"API key entry {n}: expected KEY or TENANT:KEY, the tenant of 1-64 letters, "
                "digits, '_', '.' or '-'"
            )
        pairs.append((key.strip(), name))
    return tuple(pairs)


def bearer(authorization: str | bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header (None for any other header)."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, key = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not key.strip():
        return None
    return key.strip()
