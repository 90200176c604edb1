"""What a client controls stops at the router: headers, request ids, routing fields, metrics."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.router.stub_backend import StubBackend
from tests.router.test_router_errors import assert_openai_error
from tests.support import Server, free_port, one_process

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "stub-model", "prompt": "hi"}


@pytest.fixture(scope="module")
def engine() -> Iterator[StubBackend]:
    backend = StubBackend().start()
    yield backend
    backend.stop()


def _router(engine: StubBackend, *args: str) -> Iterator[str]:
    port = free_port()
    argv = ["router", "--port", str(port), "--worker", engine.url, *one_process(args), *args]
    server = Server(argv, port, health_path="/ready").start()  # ready: the model is known
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def router(engine: StubBackend) -> Iterator[str]:
    yield from _router(engine)


@pytest.fixture(scope="module")
def keyed_router(engine: StubBackend) -> Iterator[str]:
    """Keys for clients, workers and admin; clients' KV-transfer fields accepted."""
    yield from _router(
        engine,
        "--api-key",
        "client-key",
        "--worker-api-key",
        "worker-key",
        "--admin-api-key",
        "admin-key",
        "--client-kv-transfer",
    )


def test_overlong_request_id_is_replaced_not_echoed(engine: StubBackend, router: str) -> None:
    sent = "r" * 8190
    resp = httpx.post(router + "/v1/completions", json=BODY, headers={"x-request-id": sent})
    assert resp.status_code == 200
    replaced = resp.headers["x-request-id"]
    assert replaced != sent and 16 <= len(replaced) <= 128
    assert engine.state.last_headers["x-request-id"] == replaced


def test_non_printable_request_id_is_replaced(engine: StubBackend, router: str) -> None:
    sent = "caf\u00e9".encode("latin-1")
    resp = httpx.post(router + "/v1/completions", json=BODY, headers=[(b"x-request-id", sent)])
    assert resp.status_code == 200
    assert resp.headers["x-request-id"].isascii()
    assert resp.headers["x-request-id"].encode() != sent


def test_request_id_of_128_printable_characters_is_kept(router: str) -> None:
    sent = "id " + "x" * 125
    resp = httpx.post(router + "/v1/completions", json=BODY, headers={"x-request-id": sent})
    assert resp.headers["x-request-id"] == sent


def test_headers_over_the_limit_are_431_in_openai_shape(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json=BODY, headers={"x-pad": "p" * 40_000})
    error = assert_openai_error(resp, 431)
    assert error["code"] == "headers_too_large"


def test_only_allow_listed_client_headers_reach_the_engine(
    engine: StubBackend, router: str
) -> None:
    headers = {
        "authorization": "Bearer client-secret",
        "cookie": "session=1",
        "x-data-parallel-rank": "3",
        "x-custom": "1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "user-agent": "spec-client/1",
    }
    assert httpx.post(router + "/v1/completions", json=BODY, headers=headers).status_code == 200
    seen = engine.state.last_headers
    assert seen["traceparent"] == headers["traceparent"]
    assert seen["user-agent"] == "spec-client/1"
    for dropped in ("authorization", "cookie", "x-data-parallel-rank", "x-custom"):
        assert dropped not in seen, dropped


def test_engines_get_the_worker_key_not_the_clients(engine: StubBackend, keyed_router: str) -> None:
    resp = httpx.post(
        keyed_router + "/v1/completions",
        json=BODY,
        headers={"authorization": "Bearer client-key"},
    )
    assert resp.status_code == 200
    assert engine.state.last_headers["authorization"] == "Bearer worker-key"


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host", "bootstrap_room"])
def test_client_kv_transfer_fields_are_refused(router: str, field: str) -> None:
    body = {**BODY, field: {"remote_host": "10.0.0.9"} if field == "kv_transfer_params" else 1}
    error = assert_openai_error(httpx.post(router + "/v1/completions", json=body), 400, field)
    assert error["code"] == "routing_field_not_allowed"


def test_client_kv_transfer_fields_pass_when_configured(
    engine: StubBackend, keyed_router: str
) -> None:
    body = {**BODY, "kv_transfer_params": {"remote_host": "10.0.0.9"}}
    resp = httpx.post(
        keyed_router + "/v1/completions",
        json=body,
        headers={"authorization": "Bearer client-key"},
    )
    assert resp.status_code == 200
    assert b"10.0.0.9" in engine.state.last_body


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json"])
def test_observability_is_open_without_an_admin_key(router: str, path: str) -> None:
    assert httpx.get(router + path).status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json"])
def test_observability_needs_the_admin_key_once_one_is_set(keyed_router: str, path: str) -> None:
    assert_openai_error(httpx.get(keyed_router + path), 401)
    data_key = {"authorization": "Bearer client-key"}
    assert_openai_error(httpx.get(keyed_router + path, headers=data_key), 401)
    admin = httpx.get(keyed_router + path, headers={"authorization": "Bearer admin-key"})
    assert admin.status_code == 200


def test_metrics_auth_api_key_accepts_a_data_key(engine: StubBackend) -> None:
    for url in _router(engine, "--api-key", "client-key", "--metrics-auth", "api_key"):
        assert_openai_error(httpx.get(url + "/metrics"), 401)
        ok = httpx.get(url + "/metrics", headers={"authorization": "Bearer client-key"})
        assert ok.status_code == 200


def test_control_plane_headers_over_the_limit_are_431(router: str) -> None:
    resp = httpx.get(router + "/health", headers={"x-pad": "p" * 40_000})
    assert_openai_error(resp, 431)
