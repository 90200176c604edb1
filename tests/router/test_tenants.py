"""Tenant-bound data keys: ``TENANT:KEY`` entries in ``api_key`` name who a request is for,
and the router counts answered requests per tenant and outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from switchyard.core.auth import admin_access, data_access
from switchyard.core.keys import ADMIN_TENANT, NO_TENANT, tenant_keys
from switchyard.router.errors import RouterError
from switchyard.router.settings import RouterSettings
from switchyard.router.tenants import TenantRequests, outcome_of
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend
from tests.support import eventually_async


def test_an_entry_with_a_colon_binds_its_key_to_the_tenant_before_it() -> None:
    assert tenant_keys("team-a:k1, k2") == ((b"k1", "team-a"), (b"k2", NO_TENANT))


def test_a_bad_tenant_name_is_refused_without_echoing_the_key() -> None:
    with pytest.raises(ValueError, match="entry 2") as refused:
        tenant_keys("k1,bad tenant:secret-key")
    assert "secret-key" not in str(refused.value)


def test_an_entry_with_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError):
        tenant_keys("team-a:")


def test_router_settings_refuse_a_bad_tenant_entry_at_start() -> None:
    with pytest.raises(ValidationError):
        RouterSettings(api_key="no spaces:k1")


def test_a_request_acts_for_the_tenant_its_key_is_bound_to() -> None:
    check = data_access("team-a:k1,team-b:k2,k3")
    assert check.tenant("Bearer k2") == "team-b"
    assert check.tenant(b"Bearer k1") == "team-a"


def test_a_key_bound_to_no_tenant_acts_for_the_default_tenant() -> None:
    assert data_access("team-a:k1,k3").tenant("Bearer k3") == NO_TENANT


def test_the_admin_key_on_the_data_api_acts_for_the_admin_tenant() -> None:
    assert data_access("team-a:k1", "root").tenant("Bearer root") == ADMIN_TENANT


def test_a_wrong_or_missing_key_acts_for_no_one() -> None:
    check = data_access("team-a:k1")
    assert check.tenant("Bearer team-a:k1") is None
    assert check.tenant("Bearer k2") is None
    assert check.tenant(None) is None
    assert not check.allows("Bearer k2")


def test_an_open_data_api_serves_everyone_as_the_default_tenant() -> None:
    assert data_access(None).tenant(None) == NO_TENANT


def test_a_closed_admin_api_without_a_key_acts_for_no_one() -> None:
    assert admin_access(None).tenant("Bearer anything") is None


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "ok"),
        (400, "client_error"),
        (401, "unauthorized"),
        (429, "rate_limited"),
        (499, "client_gone"),
        (503, "server_error"),
    ],
)
def test_an_answer_status_maps_to_one_outcome(status: int, outcome: str) -> None:
    assert outcome_of(status) == outcome


def test_answered_requests_are_counted_per_tenant_and_outcome() -> None:
    registry = CollectorRegistry()
    tenants = TenantRequests(registry)
    tenants.count("team-a", 200)
    tenants.count("team-a", 200)
    tenants.count("team-b", 503)
    tenants.count(None, 401)

    def value(tenant: str, outcome: str) -> float | None:
        return registry.get_sample_value(
            "switchyard_router_tenant_requests_total", {"tenant": tenant, "outcome": outcome}
        )

    assert value("team-a", "ok") == 2.0
    assert value("team-b", "server_error") == 1.0
    assert value("unknown", "unauthorized") == 1.0
    assert value("team-b", "ok") is None


@pytest.fixture
async def tenant_router(engine: StubBackend) -> AsyncIterator[InProcessRouter]:
    """A router with two tenants' keys in front of a stub engine."""
    keys = {"api_key": "team-a:key-a,team-b:key-b", "metrics_auth": "none"}
    async with running_router(engine.url, **keys) as router:
        yield router


async def test_the_router_counts_each_request_under_its_keys_tenant(
    tenant_router: InProcessRouter,
) -> None:
    body = {"model": "stub-model", "prompt": "hi"}
    statuses = []
    for key in ("key-a", "key-a", "key-b", "wrong"):
        headers = {"authorization": f"Bearer {key}"}
        resp = await tenant_router.post("/v1/completions", json=body, headers=headers)
        statuses.append(resp.status_code)
    assert statuses == [200, 200, 200, 401]
    text = (await tenant_router.get("/metrics")).text
    assert 'switchyard_router_tenant_requests_total{outcome="ok",tenant="team-a"} 2.0' in text
    assert 'switchyard_router_tenant_requests_total{outcome="ok",tenant="team-b"} 1.0' in text
    assert (
        'switchyard_router_tenant_requests_total{outcome="unauthorized",tenant="unknown"} 1.0'
        in text
    )


def test_a_tenant_at_its_in_flight_limit_gets_429_with_retry_after() -> None:
    tenants = TenantRequests(CollectorRegistry(), max_in_flight=2, retry_after_s=3)
    tenants.admit("team-a")
    tenants.admit("team-a")
    with pytest.raises(RouterError) as refused:
        tenants.admit("team-a")
    assert refused.value.status == 429
    assert refused.value.code == "tenant_concurrency_limit"
    assert refused.value.headers == {"retry-after": "3"}


def test_one_tenant_at_its_limit_leaves_another_tenant_admitted() -> None:
    tenants = TenantRequests(CollectorRegistry(), max_in_flight=1)
    tenants.admit("team-a")
    tenants.admit("team-b")
    assert tenants.in_flight == {"team-a": 1, "team-b": 1}


def test_a_released_request_frees_its_tenants_slot() -> None:
    tenants = TenantRequests(CollectorRegistry(), max_in_flight=1)
    tenants.admit("team-a")
    tenants.release("team-a")
    tenants.admit("team-a")
    assert tenants.in_flight == {"team-a": 1}


def test_without_a_limit_a_tenant_is_never_refused() -> None:
    tenants = TenantRequests(CollectorRegistry())
    for _ in range(1000):
        tenants.admit("team-a")
    assert tenants.in_flight == {"team-a": 1000}


async def test_the_router_refuses_a_tenant_over_its_limit_while_serving_the_other(
    engine: StubBackend,
) -> None:
    """Each tenant may hold one request at once: team-a's second gets 429 while its first
    is held by a hung engine, and team-b's first still reaches the engine."""
    engine.state.hang = True
    keys = {"api_key": "team-a:key-a,team-b:key-b"}
    one_each = {"router": {"limits": {"max_in_flight_per_tenant": 1}}}
    body = {"model": "stub-model", "prompt": "hi"}
    async with running_router(engine.url, config=one_each, **keys) as router:

        def send(key: str) -> asyncio.Task[object]:
            headers = {"authorization": f"Bearer {key}"}
            return asyncio.create_task(router.post("/v1/completions", json=body, headers=headers))

        held = [send("key-a")]
        try:
            await eventually_async(lambda: engine.state.requests == 1)
            over = await router.post(
                "/v1/completions", json=body, headers={"authorization": "Bearer key-a"}
            )
            held.append(send("key-b"))
            await eventually_async(lambda: engine.state.requests == 2)
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "tenant_concurrency_limit"
    assert engine.state.requests == 2
