"""A request body near the size cap is read once and its memory given back."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from tests.router.conftest import StartRouter
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(180)

BIG_PROMPT_BYTES = 31 * 2**20  # with the JSON around it, just under the 32 MiB default cap


def _big_body() -> bytes:
    return b'{"model": "stub-model", "prompt": "' + b"x" * BIG_PROMPT_BYTES + b'"}'


def test_rss_returns_near_baseline_and_health_answers_during_32mb_bodies(
    stub: StubBackend, start_router: StartRouter
) -> None:
    """The default policy (kv_aware) would turn such a prompt into millions of token ids;
    beyond kv.max_prompt_tokens it is routed by load instead."""
    server = start_router(stub.url)
    assert server.proc is not None
    router = psutil.Process(server.proc.pid)
    for _ in range(20):
        httpx.post(server.url + "/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    baseline = router.memory_info().rss
    slowest = 0.0
    done = threading.Event()

    def watch_health() -> None:
        nonlocal slowest
        while not done.is_set():
            began = time.monotonic()
            httpx.get(server.url + "/health", timeout=60)
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    body = _big_body()
    try:
        for _ in range(2):
            resp = httpx.post(
                server.url + "/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )
            assert resp.status_code == 200, resp.text[:500]
    finally:
        done.set()
        watcher.join()
    assert router.memory_info().rss < baseline * 1.10
    assert slowest < 5.0
