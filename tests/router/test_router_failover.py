"""Retries move a request to the next-best worker before any byte reached the client."""

from __future__ import annotations

from tests.router.conftest import dead_url
from tests.router.inprocess import running_router
from tests.router.stub_backend import StubBackend

BODY = {"model": "stub-model", "prompt": "hi"}
NO_PROBES = {"balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000}}


async def test_refused_worker_is_skipped_with_zero_client_errors(engine: StubBackend) -> None:
    workers = (dead_url() + ";models=stub-model", engine.url)
    async with running_router(*workers, config=NO_PROBES) as router:
        statuses = [
            (await router.post("/v1/completions", json=BODY)).status_code for _ in range(20)
        ]
    assert statuses == [200] * 20
    assert engine.state.requests == 20


async def test_503_from_one_worker_is_retried_on_another(
    engine: StubBackend, engine2: StubBackend
) -> None:
    engine.state.status = 503
    async with running_router(engine.url, engine2.url, config=NO_PROBES) as router:
        statuses = [
            (await router.post("/v1/completions", json=BODY)).status_code for _ in range(10)
        ]
    assert statuses == [200] * 10
    assert engine2.state.requests == 10


async def test_all_workers_503_relays_the_last_answer(
    engine: StubBackend, engine2: StubBackend
) -> None:
    engine.state.status = engine2.state.status = 503
    async with running_router(engine.url, engine2.url, config=NO_PROBES) as router:
        resp = await router.post("/v1/completions", json=BODY)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "stub failure"
    assert engine.state.requests + engine2.state.requests == 3  # max_attempts


async def test_streams_are_not_retried_after_the_first_byte(
    engine: StubBackend, engine2: StubBackend
) -> None:
    # Each worker cuts its stream after two events: the bytes the client has are not sent
    # again by another worker (the in-process client reads a whole answer, so it ends).
    engine.state.cut_after_chunks = engine2.state.cut_after_chunks = 2
    engine.state.chunk_interval_s = engine2.state.chunk_interval_s = 0.001
    async with running_router(engine.url, engine2.url, config=NO_PROBES) as router:
        resp = await router.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200
    assert resp.content.startswith(b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"error"')
    assert engine.state.requests + engine2.state.requests == 1
