"""What a client controls stops at the router: headers, request ids, routing fields, metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend
from tests.router.test_router_errors import assert_openai_error

BODY = {"model": "stub-model", "prompt": "hi"}


@pytest.fixture
async def router(engine: StubBackend) -> AsyncIterator[InProcessRouter]:
    async with running_router(engine.url) as router:
        yield router


@pytest.fixture
async def keyed_router(engine: StubBackend) -> AsyncIterator[InProcessRouter]:
    """Keys for clients, workers and admin; clients' KV-transfer fields accepted."""
    async with running_router(
        engine.url,
        api_key="client-key",
        worker_api_key="worker-key",
        admin_api_key="admin-key",
        client_kv_transfer=True,
    ) as router:
        yield router


async def test_overlong_request_id_is_replaced_not_echoed(
    engine: StubBackend, router: InProcessRouter
) -> None:
    sent = "r" * 8190
    resp = await router.post("/v1/completions", json=BODY, headers={"x-request-id": sent})
    assert resp.status_code == 200
    replaced = resp.headers["x-request-id"]
    assert replaced != sent and 16 <= len(replaced) <= 128
    assert engine.state.last_headers["x-request-id"] == replaced


async def test_non_printable_request_id_is_replaced(
    engine: StubBackend, router: InProcessRouter
) -> None:
    sent = "caf\u00e9".encode("latin-1")
    resp = await router.post("/v1/completions", json=BODY, headers=[(b"x-request-id", sent)])
    assert resp.status_code == 200
    assert resp.headers["x-request-id"].isascii()
    assert resp.headers["x-request-id"].encode() != sent


async def test_request_id_of_128_printable_characters_is_kept(router: InProcessRouter) -> None:
    sent = "id " + "x" * 125
    resp = await router.post("/v1/completions", json=BODY, headers={"x-request-id": sent})
    assert resp.headers["x-request-id"] == sent


async def test_headers_over_the_limit_are_431_in_openai_shape(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json=BODY, headers={"x-pad": "p" * 40_000})
    error = assert_openai_error(resp, 431)
    assert error["code"] == "headers_too_large"


async def test_only_allow_listed_client_headers_reach_the_engine(
    engine: StubBackend, router: InProcessRouter
) -> None:
    headers = {
        "authorization": "Bearer client-secret",
        "cookie": "session=1",
        "x-data-parallel-rank": "3",
        "x-custom": "1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "user-agent": "spec-client/1",
    }
    assert (await router.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
    seen = engine.state.last_headers
    assert seen["traceparent"] == headers["traceparent"]
    assert seen["user-agent"] == "spec-client/1"
    for dropped in ("authorization", "cookie", "x-data-parallel-rank", "x-custom"):
        assert dropped not in seen, dropped


async def test_engines_get_the_worker_key_not_the_clients(
    engine: StubBackend, keyed_router: InProcessRouter
) -> None:
    resp = await keyed_router.post(
        "/v1/completions",
        json=BODY,
        headers={"authorization": "Bearer client-key"},
    )
    assert resp.status_code == 200
    assert engine.state.last_headers["authorization"] == "Bearer worker-key"


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host", "bootstrap_room"])
async def test_client_kv_transfer_fields_are_refused(router: InProcessRouter, field: str) -> None:
    body = {**BODY, field: {"remote_host": "10.0.0.9"} if field == "kv_transfer_params" else 1}
    error = assert_openai_error(await router.post("/v1/completions", json=body), 400, field)
    assert error["code"] == "routing_field_not_allowed"


async def test_client_kv_transfer_fields_pass_when_configured(
    engine: StubBackend, keyed_router: InProcessRouter
) -> None:
    body = {**BODY, "kv_transfer_params": {"remote_host": "10.0.0.9"}}
    resp = await keyed_router.post(
        "/v1/completions",
        json=body,
        headers={"authorization": "Bearer client-key"},
    )
    assert resp.status_code == 200
    assert b"10.0.0.9" in engine.state.last_body


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json"])
async def test_observability_is_open_without_an_admin_key(
    router: InProcessRouter, path: str
) -> None:
    assert (await router.get(path)).status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json"])
async def test_observability_needs_the_admin_key_once_one_is_set(
    keyed_router: InProcessRouter, path: str
) -> None:
    assert_openai_error(await keyed_router.get(path), 401)
    data_key = {"authorization": "Bearer client-key"}
    assert_openai_error(await keyed_router.get(path, headers=data_key), 401)
    admin = await keyed_router.get(path, headers={"authorization": "Bearer admin-key"})
    assert admin.status_code == 200


async def test_metrics_auth_api_key_accepts_a_data_key(engine: StubBackend) -> None:
    async with running_router(engine.url, api_key="client-key", metrics_auth="api_key") as r:
        assert_openai_error(await r.get("/metrics"), 401)
        ok = await r.get("/metrics", headers={"authorization": "Bearer client-key"})
        assert ok.status_code == 200


async def test_control_plane_headers_over_the_limit_are_431(router: InProcessRouter) -> None:
    resp = await router.get("/health", headers={"x-pad": "p" * 40_000})
    assert_openai_error(resp, 431)
