"""Every answer on the inference routes says which worker served it: ``none`` when the
router answered itself before choosing one, the worker's id when one was tried."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend

KEY = "secret-key"
WORKER = "x-switchyard-worker"


@pytest.fixture
async def router(engine: StubBackend) -> AsyncIterator[InProcessRouter]:
    async with running_router(engine.url, api_key=KEY) as router:
        yield router


async def post(router: InProcessRouter, body: object, **headers: str) -> httpx.Response:
    return await router.post(
        "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}", **headers}
    )


async def test_401_says_no_worker(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"model": "stub-model"})
    assert resp.status_code == 401 and resp.headers[WORKER] == "none"


async def test_400_bad_json_says_no_worker(router: InProcessRouter) -> None:
    resp = await router.post(
        "/v1/completions",
        content=b"{not json",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert resp.status_code == 400 and resp.headers[WORKER] == "none"


async def test_404_unknown_model_says_no_worker(router: InProcessRouter) -> None:
    resp = await post(router, {"model": "no-such-model", "prompt": "x"})
    assert resp.status_code == 404 and resp.headers[WORKER] == "none"


async def test_429_slo_unattainable_says_no_worker(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "prompt": "x" * 4000}
    resp = await post(router, body, **{"x-slo-ttft-ms": "0.01"})
    assert resp.status_code == 429 and resp.headers[WORKER] == "none"
    assert resp.json()["error"]["code"] == "slo_unattainable"


async def test_an_answer_names_the_worker(router: InProcessRouter, engine: StubBackend) -> None:
    resp = await post(router, {"model": "stub-model", "prompt": "x"})
    assert resp.status_code == 200 and resp.headers[WORKER] == engine.url


async def test_a_worker_s_own_error_names_the_worker(
    router: InProcessRouter, engine: StubBackend
) -> None:
    engine.state.status = 503
    resp = await post(router, {"model": "stub-model", "prompt": "x"})
    assert resp.status_code == 503 and resp.headers[WORKER] == engine.url
