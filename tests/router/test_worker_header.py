"""Every answer on the inference routes says which worker served it: ``none`` when the
router answered itself before choosing one, the worker's id when one was tried."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.router.stub_backend import StubBackend
from tests.support import Server, free_port

KEY = "secret-key"
WORKER = "x-switchyard-worker"


@pytest.fixture(scope="module")
def backend() -> Iterator[StubBackend]:
    stub = StubBackend().start()
    yield stub
    stub.stop()


@pytest.fixture(scope="module")
def router(backend: StubBackend) -> Iterator[Server]:
    port = free_port()
    argv = ["router", "--port", str(port), "--worker", backend.url, "--api-key", KEY]
    server = Server(argv, port, start_timeout_s=90).start()
    yield server
    server.stop()


def post(router: Server, body: object, **headers: str) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}", **headers},
        timeout=30,
    )


def test_401_says_no_worker(router: Server) -> None:
    resp = httpx.post(router.url + "/v1/completions", json={"model": "stub-model"}, timeout=30)
    assert resp.status_code == 401 and resp.headers[WORKER] == "none"


def test_400_bad_json_says_no_worker(router: Server) -> None:
    resp = httpx.post(
        router.url + "/v1/completions",
        content=b"{not json",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.headers[WORKER] == "none"


def test_404_unknown_model_says_no_worker(router: Server) -> None:
    resp = post(router, {"model": "no-such-model", "prompt": "x"})
    assert resp.status_code == 404 and resp.headers[WORKER] == "none"


def test_429_slo_unattainable_says_no_worker(router: Server) -> None:
    resp = post(router, {"model": "stub-model", "prompt": "x" * 4000}, **{"x-slo-ttft-ms": "0.01"})
    assert resp.status_code == 429 and resp.headers[WORKER] == "none"
    assert resp.json()["error"]["code"] == "slo_unattainable"


def test_an_answer_names_the_worker(router: Server, backend: StubBackend) -> None:
    resp = post(router, {"model": "stub-model", "prompt": "x"})
    assert resp.status_code == 200 and resp.headers[WORKER] == backend.url


# Last: the worker's 503s may open its circuit breaker for the tests after it.
def test_a_worker_s_own_error_names_the_worker(router: Server, backend: StubBackend) -> None:
    backend.state.status = 503
    try:
        resp = post(router, {"model": "stub-model", "prompt": "x"})
    finally:
        backend.state.status = 200
    assert resp.status_code == 503 and resp.headers[WORKER] == backend.url
