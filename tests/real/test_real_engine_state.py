"""What the router learns from and does to a real engine: its load, and cancellation."""

from __future__ import annotations

import time

import httpx

from loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MODEL
from tests.support import Server

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a very long story about a lighthouse."}],
    "max_tokens": 1900,
    "ignore_eos": True,
    "stream": True,
}


def engine_metric(engine_url: str, name: str, **labels: str) -> float:
    return sum(values(httpx.get(engine_url + "/metrics", timeout=10).text, name, **labels))


def until(check: object, timeout_s: float = 30.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_vllm_metrics_become_the_workers_engine_load(router: Server) -> None:
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=LONG, timeout=120) as r:
        worker = r.headers["x-switchyard-worker"]
        next(r.iter_lines())

        def engine_view() -> dict:
            admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
            listing = httpx.get(router.url + "/admin/workers", headers=admin, timeout=10)
            return next(w for w in listing.json()["workers"] if w["url"] == worker)["ranks"][0]

        until(lambda: (engine_view()["engine_running"] or 0) >= 1)
        view = engine_view()
    assert view["kv_usage"] is not None and view["kv_usage"] > 0
    assert view["engine_waiting"] == 0


def test_an_abandoned_stream_is_aborted_in_the_engine(router: Server) -> None:
    # vLLM does not count client aborts in request_success_total{finished_reason="abort"};
    # an aborted request is one that stops running without finishing by its length.
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=LONG, timeout=120) as r:
        worker = r.headers["x-switchyard-worker"]
        finished = engine_metric(worker, "vllm:request_success_total")
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert engine_metric(worker, "vllm:num_requests_running") == 1
    until(lambda: engine_metric(worker, "vllm:num_requests_running") == 0)
    assert engine_metric(worker, "vllm:request_success_total") == finished
