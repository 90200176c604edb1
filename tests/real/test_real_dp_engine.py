"""An engine with two data-parallel ranks on CPU behind the router; at the end, its crash.

The last test kills the DP engine, so it stays last in this module (pytest runs a
module's tests in the order written).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from switchyard.loadtest.prom import values
from tests.real.conftest import MODEL, reset_caches, start_router
from tests.support import eventually
from tools.realvllm import VllmEngine


def chat(topic: str, max_tokens: int = 1) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"You write field notes about {topic}. " * 25},
            {"role": "user", "content": f"Describe {topic} in one line."},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def finished_per_rank(engine: VllmEngine) -> list[float]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return [sum(values(text, "vllm:request_success_total", engine=str(r))) for r in (0, 1)]


def test_concurrent_requests_spread_over_both_dp_ranks(
    dp_engine: VllmEngine, tmp_path: Path
) -> None:
    # The requests leave together (a barrier, one shared client: a client built per call
    # took long enough on a busy CI machine for each answer to end before the next came),
    # and the ranks' counters are polled, since the API server records them after answering.
    topics = ("moss", "ferns", "lichen", "algae")
    before = finished_per_rank(dp_engine)
    with start_router([dp_engine], tmp_path) as router, httpx.Client(timeout=120) as client:
        barrier = threading.Barrier(len(topics))

        def ask(topic: str) -> int:
            barrier.wait()
            return client.post(
                router.url + "/v1/chat/completions", json=chat(topic, 64)
            ).status_code

        with ThreadPoolExecutor(len(topics)) as pool:
            assert list(pool.map(ask, topics)) == [200] * len(topics)
    eventually(
        lambda: all(a > b for a, b in zip(finished_per_rank(dp_engine), before, strict=True)),
        10.0,
        0.2,
    )


def test_a_repeated_chat_returns_to_the_dp_rank_that_cached_it(
    dp_engine: VllmEngine, tmp_path: Path
) -> None:
    reset_caches([dp_engine])
    with start_router([dp_engine], tmp_path) as router:
        url = router.url + "/v1/chat/completions"
        httpx.post(url, json=chat("harbours"), timeout=120).raise_for_status()
        time.sleep(1.0)  # the rank publishes its blocks after the step
        cached = [
            httpx.post(url, json=chat("harbours"), timeout=120).json()["usage"][
                "prompt_tokens_details"
            ]["cached_tokens"]
            for _ in range(4)
        ]
    assert all(c > 0 for c in cached)


def test_killing_an_engine_causes_no_client_errors(
    pair: list[VllmEngine], dp_engine: VllmEngine, tmp_path: Path
) -> None:
    survivor = pair[0]
    statuses: list[int] = []
    served: list[str] = []
    stop = threading.Event()
    with start_router([survivor, dp_engine], tmp_path, "round_robin", events=False) as router:

        def client() -> None:
            with httpx.Client(timeout=120) as c:
                while not stop.is_set():
                    resp = c.post(router.url + "/v1/chat/completions", json=chat("rain", 2))
                    statuses.append(resp.status_code)
                    served.append(resp.headers.get("x-switchyard-worker", ""))

        thread = threading.Thread(target=client)
        thread.start()
        try:
            eventually(lambda: dp_engine.url in served, 30, 0.2)
            dp_engine.kill()
            killed_at = len(statuses)
            eventually(lambda: len(statuses) >= killed_at + 6, 30, 0.2)
        finally:
            stop.set()
            thread.join(timeout=120)
    assert statuses and set(statuses) == {200}
    assert set(served[killed_at + 1 :]) == {survivor.url}
