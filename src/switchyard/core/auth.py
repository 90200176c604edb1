"""API keys for the router, the balancer service and the kvstore service: one check for all.

A client presents its key as ``Authorization: Bearer KEY`` (on the router's Anthropic
route also as ``x-api-key: KEY``, as Anthropic's SDK sends it). A key setting holds one key,
or several separated by commas (one per client, so a key can be rotated on its own). A
data key may be bound to a tenant as ``TENANT:KEY``; the router labels that key's
requests with the tenant (so a key holds no ':' of its own).
Keys are compared with ``hmac.compare_digest`` against every configured key, so the time a
check takes tells nothing about how much of a key was right or which key matched.

Data APIs are open while no data key is set. Admin APIs are closed while no admin key is
set: they answer 403 and say how to turn them on.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Header

from switchyard.core.errors import APIError
from switchyard.core.keys import ADMIN_TENANT, NO_TENANT, bearer, keys_of, tenant_keys

ADMIN_OFF = (
    "The admin API is off: no admin key is configured. Set admin_api_key (flag, "
    "environment or config file) and send it as 'Authorization: Bearer <key>'."
)


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
    APIs) or let every request through (data APIs). ``tenants`` name each key's tenant
    (default: ``NO_TENANT`` for all).
    """

    def __init__(
        self,
        keys: tuple[bytes, ...],
        *,
        closed: bool,
        what: str,
        tenants: tuple[str, ...] | None = None,
    ) -> None:
        self.keys = keys
        self.tenants = tenants if tenants is not None else (NO_TENANT,) * len(keys)
        self.closed = closed
        self.what = what

    def tenant(self, authorization: str | bytes | None) -> str | None:
        """The tenant a request with this Authorization header acts for (``NO_TENANT``
        while no key is set and the API is open); None: the request may not pass.
        Compares with every key, in constant time each."""
        if not self.keys:
            return None if self.closed else NO_TENANT
        return self._match(bearer(authorization))

    def tenant_of_key(self, key: bytes | None) -> str | None:
        """As ``tenant``, for a bare key (an ``x-api-key`` header's value)."""
        if not self.keys:
            return None if self.closed else NO_TENANT
        return self._match(key.strip() or None if key is not None else None)

    def _match(self, given: bytes | None) -> str | None:
        found: str | None = None
        for key, tenant in zip(self.keys, self.tenants, strict=True):
            if hmac.compare_digest(given or b"", key):
                found = tenant
        return found if given is not None else None

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether a request with this Authorization header may pass (no key set: not closed)."""
        return self.tenant(authorization) is not None

    def __call__(self, authorization: Annotated[str | None, Header()] = None) -> None:
        if not self.keys and self.closed:
            raise APIError(403, ADMIN_OFF, code="admin_api_disabled")
        if not self.allows(authorization):
            raise unauthorized(self.what)


def admin_access(admin_api_key: str | None) -> RequireKey:
    """The admin check: closed until ``admin_api_key`` is set."""
    return RequireKey(keys_of(admin_api_key), closed=True, what="admin API key")


def data_access(api_key: str | None, admin_api_key: str | None = None) -> RequireKey:
    """The data check: open until ``api_key`` is set; then any data key (its tenant as
    bound), or the admin key (whoever may change the service may also use it; tenant
    ``ADMIN_TENANT``)."""
    pairs = tenant_keys(api_key)
    if not pairs:
        return RequireKey((), closed=False, what="API key")
    admin = keys_of(admin_api_key)
    return RequireKey(
        tuple(key for key, _ in pairs) + admin,
        closed=False,
        what="API key",
        tenants=tuple(tenant for _, tenant in pairs) + (ADMIN_TENANT,) * len(admin),
    )


def startup_line(service: str, admin_api_key: str | None, api_key: str | None = None) -> str:
    """The one log line a service prints at start about its keys."""
    admin = "on (admin key set)" if admin_api_key else "off (set admin_api_key to enable it)"
    data = "key required" if api_key else "open (set api_key to require one)"
    return f"{service}: admin API {admin}; data API {data}"
