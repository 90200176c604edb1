"""A router given only worker URLs learns each engine's block size from its events: a fleet
whose engines use different block sizes routes and predicts cached tokens correctly."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.router.conftest import StartRouter
from tests.support import TOKENIZER_DIR, Server, free_port, metric

pytestmark = pytest.mark.timeout(120)

PREDICTED = "switchyard_router_predicted_cached_tokens_total"
ACTUAL = "switchyard_router_actual_cached_tokens_total"


@pytest.fixture(scope="module")
def mixed() -> Iterator[dict[int, str]]:
    """Two vLLM mocks with KV events, one keying 16-token blocks and one 64-token blocks."""
    started: dict[int, Server] = {}
    try:
        for size in (16, 64):
            port = free_port()
            argv = ["mock", "--port", str(port), "--model", "m", "--speed", "100"]
            argv += ["--kv-events-port", str(free_port()), "--block-size", str(size)]
            started[size] = Server(argv, port).start()
        yield {size: s.url for size, s in started.items()}
    finally:
        for server in started.values():
            server.stop()


def chat(topic: str, turn: int) -> dict:
    return {
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": f"You explain {topic} in full sentences. " * 60},
            {"role": "user", "content": f"Question {turn} about {topic}?"},
        ],
    }


def counters(router: str) -> tuple[float, float]:
    text = httpx.get(router + "/metrics").text
    return metric(text, PREDICTED), metric(text, ACTUAL)


def test_engines_with_different_block_sizes_are_each_predicted_in_their_own(
    mixed: dict[int, str], start_router: StartRouter
) -> None:
    router = start_router(
        *mixed.values(), args=("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR))
    ).url
    for url in mixed.values():
        httpx.post(url + "/reset_prefix_cache").raise_for_status()
    holders: dict[str, set[str]] = {}
    for topic in ("glaciers", "harbours", "volcanoes", "deltas"):
        for turn in range(3):
            before = counters(router)
            resp = httpx.post(router + "/v1/chat/completions", json=chat(topic, turn), timeout=30)
            assert resp.status_code == 200
            worker = resp.headers["x-switchyard-worker"]
            holders.setdefault(topic, set()).add(worker)
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            after = counters(router)
            size = next(s for s, u in mixed.items() if u == worker)
            assert after[1] - before[1] == cached
            assert abs((after[0] - before[0]) - cached) <= size
            if turn:
                assert cached > 500
            time.sleep(0.1)
    assert all(len(served) == 1 for served in holders.values())
    assert {w for served in holders.values() for w in served} == set(mixed.values())
