"""What the router learns from and does to a real engine: its load, and cancellation."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx

from switchyard.loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MODEL
from tests.support import Server
from tools.realvllm import VllmEngine

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a very long story about a lighthouse."}],
    "max_tokens": 1900,
    "ignore_eos": True,
    "stream": True,
}


def engine_metric(engine_url: str, name: str, **labels: str) -> float:
    return sum(values(httpx.get(engine_url + "/metrics", timeout=10).text, name, **labels))


def test_vllm_metrics_become_the_workers_engine_load(router: Server) -> None:
    # Two long streamed answers keep the engines running while the router scrapes them;
    # the streams are closed once the router has shown the load. Many answers at once
    # would keep the API servers so busy that they answer /metrics slower than the scrape
    # timeout (see the next test's comment) and the router could miss the running
    # requests; two streams leave the API servers nearly idle.
    admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
    seen: list[dict] = []
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=300) as client, ExitStack() as streams:
        for _ in range(2):
            answer = streams.enter_context(
                client.stream("POST", router.url + "/v1/chat/completions", json=LONG)
            )
            assert answer.status_code == 200
        while time.monotonic() < deadline and not shows_load(seen):
            listing = client.get(router.url + "/admin/workers", headers=admin).json()
            seen += [w["ranks"][0] for w in listing["workers"]]
            time.sleep(0.2)
    assert max(rank["engine_running"] or 0 for rank in seen) >= 1
    assert max(rank["kv_usage"] or 0.0 for rank in seen) > 0


def shows_load(ranks: list[dict]) -> bool:
    running = any((rank["engine_running"] or 0) >= 1 for rank in ranks)
    return running and any((rank["kv_usage"] or 0.0) > 0 for rank in ranks)


def settled(engine_url: str, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Waits until the engine runs and queues nothing and its generated-token count stays
    put for ``quiet_s``: a request still running moves that count every step."""
    deadline = time.monotonic() + timeout_s
    last = engine_metric(engine_url, "vllm:generation_tokens_total")
    while True:
        time.sleep(quiet_s)
        now = engine_metric(engine_url, "vllm:generation_tokens_total")
        idle = engine_metric(engine_url, "vllm:num_requests_running") == 0
        idle = idle and engine_metric(engine_url, "vllm:num_requests_waiting") == 0
        if idle and now == last:
            return
        assert time.monotonic() < deadline, "the engine did not settle in time"
        last = now


def test_an_abandoned_stream_is_aborted_in_the_engine(
    router: Server, pair: list[VllmEngine]
) -> None:
    # vLLM does not count client aborts in request_success_total{finished_reason="abort"};
    # an aborted request is one that leaves the engine without finishing by its length.
    # 32 answers of 1900 tokens keep the engine busy for seconds past the disconnect. (A
    # busy API server can lag its engine so far that the running gauge never shows the
    # request, so the test does not wait for it: it waits for the engine to settle, and
    # an unaborted request would have finished, counted, by then.) The counts are read
    # before the request: read while an engine streams the 32 answers, its /metrics can
    # take long enough for every token to be generated before the client reads a line.
    before = {}
    for engine in pair:
        settled(engine.url)
        before[engine.url] = (
            engine_metric(engine.url, "vllm:request_success_total"),
            engine_metric(engine.url, "vllm:generation_tokens_total"),
        )
    body = {**LONG, "n": 32}
    sent = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=120) as r:
        worker = r.headers["x-switchyard-worker"]
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    closed_s = time.monotonic() - sent
    finished, generated = before[worker]
    settled(worker)
    tokens = engine_metric(worker, "vllm:generation_tokens_total") - generated
    done = engine_metric(worker, "vllm:request_success_total") - finished
    assert (done, tokens < 32 * 1900) == (0, True), f"{tokens=:.0f}, closed after {closed_s:.2f} s"
