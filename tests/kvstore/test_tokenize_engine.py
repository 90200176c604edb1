"""A tokenizer that asks the engine's ``/tokenize`` does so only awaiting, through one kept
connection pool, and keeps its connection between calls."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.net.errors import TransportError
from tests.support import JSONHandler, LoopbackHTTPServer, free_port, serving


class _Engine(LoopbackHTTPServer):
    """``POST /tokenize`` answering one token per word; counts connections and requests."""

    def __init__(self) -> None:
        super().__init__(_Handler)
        self.connections = 0
        self.requests = 0
        self.status = 200


class _Handler(JSONHandler):
    server: _Engine

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        self.server.requests += 1
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        words = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        self.send_json({"tokens": list(range(len(words.split())))}, self.server.status)


@pytest.fixture
def engine() -> Iterator[_Engine]:
    with serving(_Engine()) as server:
        yield server


async def test_uncached_calls_share_one_connection_and_cached_ones_send_nothing(
    engine: _Engine,
) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    try:
        assert await tok.aencode_prompt("one two three") == [0, 1, 2]
        assert await tok.aencode_prompt("four five") == [0, 1]
        assert await tok.aencode_chat([{"role": "user", "content": "six"}]) == [0]
        assert await tok.aencode_prompt("one two three") == [0, 1, 2]
    finally:
        await tok.aclose()
    assert engine.requests == 3
    assert engine.connections == 1


def test_an_engine_tokenizer_refuses_to_block_and_sends_nothing(engine: _Engine) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    with pytest.raises(RuntimeError, match="aencode_prompt"):
        tok.encode_prompt("one two")
    with pytest.raises(RuntimeError, match="aencode_chat"):
        tok.encode_chat([{"role": "user", "content": "three"}])
    assert tok.encode_prompt([4, 5]) == [4, 5]  # ids given are ids, in every mode
    assert engine.requests == 0


async def test_an_engine_error_status_is_a_value_error_and_is_not_cached(
    engine: _Engine,
) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    try:
        engine.status = 500
        with pytest.raises(ValueError, match="HTTP 500"):
            await tok.aencode_prompt("one two")
        engine.status = 200
        assert await tok.aencode_prompt("one two") == [0, 1]
    finally:
        await tok.aclose()
    assert engine.requests == 2
    assert engine.connections == 1  # an error answer leaves its connection reusable


async def test_an_unreachable_engine_is_a_transport_error() -> None:
    tok = RoutingTokenizer.from_engine(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(TransportError):
            await tok.aencode_prompt("one")
    finally:
        await tok.aclose()


async def test_a_closed_tokenizer_connects_again_when_asked_again(engine: _Engine) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    await tok.aencode_prompt("one")
    await tok.aclose()
    await tok.aencode_prompt("two")
    await tok.aclose()
    assert engine.connections == 2
