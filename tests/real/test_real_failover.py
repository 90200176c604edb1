"""Failover before the first byte on real vLLM: the abandoned attempt stops running.

A non-streamed answer has a first-byte deadline that grows with its ``max_tokens``; here
the allowance per token is tiny, so the first worker is left for the second long before
it could finish. The router closes the first attempt's connection, and vLLM aborts a
request whose client has gone: the first engine stops generating while the second one
writes the whole answer.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from switchyard.loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MODEL, reset_caches, start_router
from tools.realvllm import VllmEngine

MAX_TOKENS = 1500


def scrape(url: str, name: str) -> float:
    admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}  # the router's; engines ignore it
    return sum(values(httpx.get(url + "/metrics", headers=admin, timeout=30).text, name))


def test_a_late_first_byte_moves_the_request_and_the_first_engine_aborts_it(
    pair: list[VllmEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset_caches(pair)
    monkeypatch.setenv("SWITCHYARD_ROUTER_TIMEOUTS__FIRST_BYTE_BASE_S", "0.5")
    monkeypatch.setenv("SWITCHYARD_ROUTER_TIMEOUTS__OUTPUT_TOKEN_ALLOWANCE_S", "0.0005")
    router = start_router(
        pair, tmp_path, policy="round_robin", events=False, extra=("--retry-max-attempts", "2")
    )
    try:
        counters = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
        counters += ("vllm:request_success_total",)
        before = {e.url: {c: scrape(e.url, c) for c in counters} for e in pair}
        body = {
            "model": MODEL,
            "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        resp = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert scrape(router.url, "switchyard_router_retries_total") >= 1
        answered = resp.headers["x-switchyard-worker"]
        (abandoned,) = [e.url for e in pair if e.url != answered]
        grew = {
            url: {c: scrape(url, c) - before[url][c] for c in counters}
            for url in (abandoned, answered)
        }
        # The abandoned engine took the prompt and began generating, then stopped: it
        # finished nothing and generated less than the answer; it runs nothing now.
        assert grew[abandoned]["vllm:prompt_tokens_total"] > 0
        assert 0 < grew[abandoned]["vllm:generation_tokens_total"] < MAX_TOKENS
        assert grew[abandoned]["vllm:request_success_total"] == 0
        assert scrape(abandoned, "vllm:num_requests_running") == 0
        assert grew[answered]["vllm:request_success_total"] == 1
        assert grew[answered]["vllm:generation_tokens_total"] == MAX_TOKENS
    finally:
        router.stop()
