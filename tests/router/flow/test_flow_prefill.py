"""Queued prefill ends at a stream's first token, not at its first byte.

Flow control holds requests in the router while a worker has ``max_queued_prefill_tokens``
of this router's prompts not yet prefilled; the router reads a stream's first chunk as that
request's first token. A chat stream that opened with a token-less role chunk the moment it
was accepted (as vLLM's does not) would clear the count at once, and the flood it then lets
through waits on the engine, ahead of every other tenant. These tests pin the mock engine,
which the fairness bench runs, to vLLM's order through the router.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from switchyard.router.app import RouterApp
from tests.router.inprocess import running_router
from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(60)

MODEL = "mock-model"


@pytest.fixture(scope="module")
def engine() -> Iterator[Server]:
    port = free_port()
    with Server(["mock", "--port", str(port), "--model", MODEL, "--speed", "20"], port) as srv:
        yield srv


def events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.split(b"\n\n"):
        data = block.strip().removeprefix(b"data: ")
        if data and data != b"[DONE]":
            out.append(orjson.loads(data))
    return out


async def test_the_chunk_read_as_first_token_carries_one(engine: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a story " * 200}],
        "max_tokens": 4,
        "stream": True,
    }
    firsts: list[bytes] = []
    async with running_router(engine.url) as router:
        app = router.app
        assert isinstance(app, RouterApp)
        relay = app.forwarder.relay
        read_first = relay.first_chunk

        async def first_chunk(*args: Any) -> bytes:
            chunk = await read_first(*args)
            firsts.append(chunk)
            return chunk

        relay.first_chunk = first_chunk  # type: ignore[method-assign]
        answer = await router.post("/v1/chat/completions", json=body)
        (worker,) = app.fleet.workers()
    assert answer.status_code == 200
    (first,) = firsts
    deltas = [e["choices"][0]["delta"] for e in events(first)]
    assert deltas[0]["role"] == "assistant"
    assert any(d.get("content") for d in deltas), "the stream opened before any token"
    assert events(answer.content)[-1]["choices"][0]["finish_reason"] == "length"
    # the first token took the prompt off the worker's queued prefill, exactly once
    assert worker.totals.prefill_tokens == 0
    assert worker.inflight == 0
