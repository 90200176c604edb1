"""API keys for the router, the balancer service and the kvstore service: one check for all.

A client presents its key as ``Authorization: Bearer KEY``. A key setting holds one key,
or several separated by commas (one per client, so a key can be rotated on its own).
Keys are compared with ``hmac.compare_digest`` against every configured key, so the time a
check takes tells nothing about how much of a key was right or which key matched.

Data APIs are open while no data key is set. Admin APIs are closed while no admin key is
set: they answer 403 and say how to turn them on.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Header

from switchyard.errors import APIError

ADMIN_OFF = (
    "The admin API is off: no admin key is configured. Set admin_api_key (flag, "
    "environment or config file) and send it as 'Authorization: Bearer <key>'."
)


def keys_of(setting: str | None) -> tuple[bytes, ...]:
    """The keys a setting holds: none, one, or several separated by commas."""
    if not setting:
        return ()
    return tuple(k.strip().encode() for k in setting.split(",") if k.strip())


def bearer(authorization: str | bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header (None for any other header)."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, key = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not key.strip():
        return None
    return key.strip()


def key_matches(given: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """True if ``given`` is one of ``keys``; compares with every key, in constant time each."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given or b"", key)
    return found and given is not None


def unauthorized(what: str) -> APIError:
    return APIError(
        401,
        f"Invalid or missing {what}: send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


class RequireKey:
    """FastAPI dependency: the request must carry one of the configured keys.

    ``closed`` decides what happens while no key is configured: refuse with 403 (admin
    APIs) or let every request through (data APIs).
    """

    def __init__(self, keys: tuple[bytes, ...], *, closed: bool, what: str) -> None:
        self.keys = keys
        self.closed = closed
        self.what = what

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether a request with this Authorization header may pass (no key set: not closed)."""
        if not self.keys:
            return not self.closed
        return key_matches(bearer(authorization), self.keys)

    def __call__(self, authorization: Annotated[str | None, Header()] = None) -> None:
        if not self.keys and self.closed:
            raise APIError(403, ADMIN_OFF, code="admin_api_disabled")
        if not self.allows(authorization):
            raise unauthorized(self.what)


def admin_access(admin_api_key: str | None) -> RequireKey:
    """The admin check: closed until ``admin_api_key`` is set."""
    return RequireKey(keys_of(admin_api_key), closed=True, what="admin API key")


def data_access(api_key: str | None, admin_api_key: str | None = None) -> RequireKey:
    """The data check: open until ``api_key`` is set; then any data key, or the admin key
    (whoever may change the service may also use it)."""
    keys = keys_of(api_key)
    return RequireKey(keys + keys_of(admin_api_key) if keys else (), closed=False, what="API key")


def startup_line(service: str, admin_api_key: str | None, api_key: str | None = None) -> str:
    """The one log line a service prints at start about its keys."""
    admin = "on (admin key set)" if admin_api_key else "off (set admin_api_key to enable it)"
    data = "key required" if api_key else "open (set api_key to require one)"
    return f"{service}: admin API {admin}; data API {data}"
