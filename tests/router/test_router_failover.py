"""Retries move a request to the next-best worker before any byte reached the client."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import StartRouter, dead_url
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "stub-model", "prompt": "hi"}
NO_PROBES = {"balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000}}


def test_refused_worker_is_skipped_with_zero_client_errors(
    stub: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(dead_url() + ";models=stub-model", stub.url, config=NO_PROBES).url
    statuses = [httpx.post(router + "/v1/completions", json=BODY).status_code for _ in range(20)]
    assert statuses == [200] * 20
    assert stub.state.requests == 20


def test_503_from_one_worker_is_retried_on_another(
    stub: StubBackend, stub2: StubBackend, start_router: StartRouter
) -> None:
    stub.state.status = 503
    router = start_router(stub.url, stub2.url, config=NO_PROBES).url
    statuses = [httpx.post(router + "/v1/completions", json=BODY).status_code for _ in range(10)]
    assert statuses == [200] * 10
    assert stub2.state.requests == 10


def test_all_workers_503_relays_the_last_answer(
    stub: StubBackend, stub2: StubBackend, start_router: StartRouter
) -> None:
    stub.state.status = stub2.state.status = 503
    router = start_router(stub.url, stub2.url, config=NO_PROBES).url
    resp = httpx.post(router + "/v1/completions", json=BODY)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "stub failure"
    assert stub.state.requests + stub2.state.requests == 3  # max_attempts


def test_streams_are_not_retried_after_the_first_byte(
    stub: StubBackend, stub2: StubBackend, start_router: StartRouter
) -> None:
    stub.state.chunk_interval_s = stub2.state.chunk_interval_s = 0.001
    router = start_router(stub.url, stub2.url, config=NO_PROBES).url
    with httpx.stream("POST", router + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        next(resp.iter_raw())
    assert stub.state.requests + stub2.state.requests == 1
