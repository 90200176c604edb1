"""Requests per tenant: the tenant a data key is bound to (``TENANT:KEY`` in ``api_key``)
labels each request the router answers, so one tenant's traffic and failures can be told
from another's, and may hold at most ``limits.max_in_flight_per_tenant`` requests at once, so one
tenant's flood cannot take every slot of the fleet from the others.

Tenant names come only from the configuration (``switchyard.core.keys.tenant_keys``), so the
label set is bounded; a request whose key matched none is counted under ``UNKNOWN``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from switchyard.router.errors import RouterError

# The tenant label of a request refused for its key (a client's guess never becomes a label).
UNKNOWN = "unknown"
OUTCOMES = ("ok", "client_error", "unauthorized", "rate_limited", "client_gone", "server_error")


def outcome_of(status: int) -> str:
    """The outcome label of an answer with HTTP ``status`` (499: the client left first)."""
    if status < 400:
        return "ok"
    if status == 401:
        return "unauthorized"
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "client_gone"
    return "client_error" if status < 500 else "server_error"


class TenantRequests:
    """``switchyard_router_tenant_requests_total{tenant,outcome}`` on ``registry``."""

    def __init__(
        self, registry: CollectorRegistry, max_in_flight: int = 0, retry_after_s: int = 1
    ) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight: dict[str, int] = {}
        self.counter = Counter(
            "switchyard_router_tenant_requests",
            "Requests answered per tenant of the client's API key ('default': a key bound to "
            "none or no key required; 'unknown': refused for its key), by outcome.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self._children: dict[tuple[str, int], Counter] = {}

    def count(self, tenant: str | None, status: int) -> None:
        """One answered request of ``tenant`` (None: its key matched none)."""
        key = (tenant or UNKNOWN, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.counter.labels(key[0], outcome_of(status))
        child.inc()

    def admit(self, tenant: str) -> None:
        """Count a request of ``tenant`` in flight, or raise 429 when it already holds
        ``max_in_flight`` (0: no limit). Every admitted request is ``release``d once."""
        held = self.in_flight.get(tenant, 0)
        if self.max_in_flight and held >= self.max_in_flight:
            raise RouterError(
                429,
                f"Too many requests in flight for this API key's tenant ({held}); retry later",
                code="tenant_concurrency_limit",
                headers={"retry-after": str(self.retry_after_s)},
            )
        self.in_flight[tenant] = held + 1

    def release(self, tenant: str) -> None:
        held = self.in_flight[tenant] - 1
        if held:
            self.in_flight[tenant] = held
        else:
            del self.in_flight[tenant]
