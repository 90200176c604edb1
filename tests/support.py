"""Test support: the package's process launcher, the test tokenizer, metric reading, and
the one way a test waits for something another thread, task or process does."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

from switchyard.loadtest.procs import Server, free_port, free_port_block, redis_server, wait_http
from switchyard.loadtest.prom import values
from switchyard.mock.settings import DEFAULT_TOKENIZER

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = Path(DEFAULT_TOKENIZER)

__all__ = [
    "REPO",
    "JSONHandler",
    "LoopbackHTTPServer",
    "serving",
    "TOKENIZER_DIR",
    "Server",
    "free_port",
    "eventually",
    "eventually_async",
    "free_port_block",
    "metric",
    "one_process",
    "redis_server",
    "wait_http",
]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``; none is a failure."""
    found = values(text, name, **labels)
    assert found, f"{name}{labels} not in metrics"
    return sum(found)


def one_process(args: Sequence[str] = ()) -> list[str]:
    """``--processes 1`` unless ``args`` set the count: under the default (one router process
    per core) which process takes a connection, with its own counters, caps and round-robin
    turn, would be part of every test that starts a router."""
    return [] if "--processes" in args else ["--processes", "1"]


def _timed_out(predicate: object, timeout_s: float, message: str | None) -> AssertionError:
    what = message or getattr(predicate, "__name__", repr(predicate))
    return AssertionError(f"not true within {timeout_s} s: {what}")


def eventually(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    message: str | None = None,
) -> T:
    """``predicate()``'s first truthy value, polled every ``interval_s``; an
    ``AssertionError`` after ``timeout_s``. The bound is a ceiling for a loaded machine,
    never what a test asserts: a test that waits for an event states the event."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(predicate, timeout_s, message)
        time.sleep(interval_s)


async def eventually_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    message: str | None = None,
) -> T:
    """:func:`eventually` in an event loop: the loop runs between polls, and ``predicate``
    may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise _timed_out(predicate, timeout_s, message)
        await asyncio.sleep(interval_s)


class LoopbackHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server on a free loopback port: a stand-in engine whose slowness is
    its own threads', not the test's event loop's."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class JSONHandler(BaseHTTPRequestHandler):
    """Kept alive unless the client closes; answers JSON; logs nothing."""

    protocol_version = "HTTP/1.1"

    def send_json(self, value: object, status: int = 200) -> None:
        raw = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: object) -> None:
        pass


S = TypeVar("S", bound=LoopbackHTTPServer)


@contextlib.contextmanager
def serving(server: S) -> Iterator[S]:
    """``server`` answering in a thread of its own until the block ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
