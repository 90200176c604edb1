"""A tokenizer that asks the engine's ``/tokenize`` keeps its connection between calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from switchyard.kvstore.tokenize import RoutingTokenizer


class _Engine(ThreadingHTTPServer):
    """``POST /tokenize`` answering one token per word; counts connections and requests."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive unless the client closes
    server: _Engine

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        self.server.requests += 1
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        words = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        answer = json.dumps({"tokens": list(range(len(words.split())))}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[_Engine]:
    server = _Engine()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


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


def test_the_blocking_path_keeps_its_connection_too(engine: _Engine) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    try:
        assert tok.encode_prompt("one two") == [0, 1]
        assert tok.encode_prompt("three") == [0]
    finally:
        tok.close()
    assert engine.requests == 2
    assert engine.connections == 1


async def test_a_closed_tokenizer_connects_again_when_asked_again(engine: _Engine) -> None:
    tok = RoutingTokenizer.from_engine(engine.url)
    await tok.aencode_prompt("one")
    await tok.aclose()
    await tok.aencode_prompt("two")
    await tok.aclose()
    assert engine.connections == 2
