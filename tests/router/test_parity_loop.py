"""A parity check whose tokenizer asks the engine's ``/tokenize`` keeps the event loop free
while the engine is slow to answer: the router serves its other requests meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.parity import ParityChecker
from tests.support import JSONHandler, LoopbackHTTPServer, serving

T = TypeVar("T")

pytestmark = pytest.mark.timeout(60)

# How long the engine takes to tokenize: longer than the stall the loop may show.
TOKENIZE_DELAY_S = 0.3
# The longest the loop may go without running a ready callback while the check runs.
MAX_LAG_S = 0.1
# Ids per word, so the first canary is already long enough (one /tokenize per text).
IDS_PER_WORD = 3


def _ids(text: str) -> list[int]:
    return list(range(IDS_PER_WORD * len(text.split())))


class _Engine(LoopbackHTTPServer):
    """A slow ``POST /tokenize`` and a ``POST /v1/chat/completions`` that counts its prompt
    in the same ids, in threads of their own (the slowness is the engine's, not the loop's)."""

    def __init__(self) -> None:
        super().__init__(_Handler)
        self.tokenized: list[dict[str, Any]] = []


class _Handler(JSONHandler):
    server: _Engine

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        if self.path == "/tokenize":
            self.server.tokenized.append(body)
            time.sleep(TOKENIZE_DELAY_S)  # the engine at work, in this server thread
            self.send_json({"tokens": _ids(text)})
        else:
            self.send_json({"usage": {"prompt_tokens": len(_ids(text)), "completion_tokens": 1}})


@pytest.fixture
def engine() -> Iterator[_Engine]:
    with serving(_Engine()) as server:
        yield server


async def _with_lag(work: Awaitable[T], tick_s: float = 0.005) -> tuple[T, float, int]:
    """``work``'s result, the longest a tick of a watcher task came late while it ran (how
    long the loop was kept from its ready callbacks), and the watcher's tick count."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def watch() -> None:
        while True:
            due = loop.time() + tick_s
            await asyncio.sleep(tick_s)
            lags.append(loop.time() - due)

    watcher = loop.create_task(watch())
    await asyncio.sleep(0)  # the watcher runs from before the work starts
    try:
        result = await work
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return result, max(lags, default=0.0), len(lags)


async def test_a_slow_engine_tokenizer_does_not_block_the_loop_during_a_parity_check(
    engine: _Engine,
) -> None:
    store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_engine(engine.url))
    try:
        async with httpx.AsyncClient() as client:
            check = ParityChecker(store).check(client, engine.url, "m")
            result, lag, ticks = await _with_lag(check)
    finally:
        await store.stop()
    # The chat canary and its content alone, each asked of the engine once.
    assert [sorted(body) for body in engine.tokenized] == [
        ["add_generation_prompt", "messages"],
        ["prompt"],
    ]
    assert result.ok is True, result
    assert ticks >= 10, "the watcher ran while the engine was tokenizing"
    assert lag < MAX_LAG_S, f"the loop stalled {lag * 1000:.0f} ms during the check"
