"""The router's HTTP/1.1 server protocol, driven in-process through a recording transport."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from switchyard.router.connections import CLIENT_GONE, ClientConnection, ConnectionLimits, Exchange

App = Callable[[Scope, Receive, Send], Awaitable[None]]
LIMITS = ConnectionLimits(
    header_timeout_s=5.0,
    body_timeout_s=5.0,
    max_connections=0,
    max_header_bytes=32 * 1024,
    keep_alive_s=5.0,
)


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name)

    @property
    def sent(self) -> bytes:
        return b"".join(self.writes)


def connect(app: App) -> tuple[ClientConnection, RecordingTransport]:
    config = SimpleNamespace(loaded=True, loaded_app=app)
    state = SimpleNamespace(connections=set(), tasks=set())
    conn = ClientConnection(config, state, {}, asyncio.get_running_loop(), limits=LIMITS)
    transport = RecordingTransport()
    conn.connection_made(transport)
    return conn, transport


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def respond(send: Send, body: bytes = b"{}") -> None:
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def answer(body: bytes = b"{}") -> App:
    """An app that reads the whole request body, then answers ``body``."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await respond(send, body)

    return app


POST = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}"


async def test_a_response_head_goes_out_with_its_body_in_one_write() -> None:
    conn, transport = connect(answer(b"hello"))
    conn.data_received(POST)
    await settle()
    assert len(transport.writes) == 1
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n")
    assert transport.writes[0].endswith(b"\r\n\r\nhello")
    assert not transport.closed


async def test_the_app_gets_path_query_headers_and_body() -> None:
    seen: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope["method"], scope["path"], scope["query_string"], scope["headers"]))
        seen.append(await receive())
        await respond(send)

    conn, _ = connect(app)
    request = b"POST /a%20b?x=1 HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nX-Id: 7 \r\n\r\n{}"
    conn.data_received(request)
    await settle()
    head = ("POST", "/a b", b"x=1", [(b"host", b"r"), (b"content-length", b"2"), (b"x-id", b"7")])
    assert seen == [head, {"type": "http.request", "body": b"{}", "more_body": False}]


async def test_a_body_in_pieces_reaches_the_app_as_it_arrives() -> None:
    bodies: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            bodies.append(message)
            if not message["more_body"]:
                break
        await respond(send)

    conn, transport = connect(app)
    conn.data_received(b"POST / HTTP/1.1\r\ncontent-length: 6\r\n\r\nabc")
    await settle()
    conn.data_received(b"def")
    await settle()
    assert [(m["body"], m["more_body"]) for m in bodies] == [(b"abc", True), (b"def", False)]
    assert transport.sent.startswith(b"HTTP/1.1 200")


async def test_pipelined_requests_are_answered_in_order() -> None:
    order: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if scope["path"] == "/slow":
            await asyncio.sleep(0.01)
        order.append(scope["path"])
        await respond(send, scope["path"].encode())

    conn, transport = connect(app)
    conn.data_received(b"GET /slow HTTP/1.1\r\n\r\nGET /fast HTTP/1.1\r\n\r\n")
    await asyncio.sleep(0.05)
    assert order == ["/slow", "/fast"]
    assert transport.sent.index(b"/slow") < transport.sent.index(b"/fast")


async def test_a_streamed_response_without_length_is_chunked() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    conn, transport = connect(app)
    conn.data_received(POST)
    await settle()
    head, _, body = transport.sent.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"


async def test_a_head_request_gets_no_body() -> None:
    conn, transport = connect(answer(b"hello"))
    conn.data_received(b"HEAD / HTTP/1.1\r\n\r\n")
    await settle()
    assert transport.sent.endswith(b"content-length: 5\r\n\r\n")


async def test_connection_close_asked_by_the_client_closes_after_the_answer() -> None:
    conn, transport = connect(answer())
    conn.data_received(b"GET / HTTP/1.1\r\nconnection: close\r\n\r\n")
    await settle()
    assert b"connection: close\r\n" in transport.sent
    assert transport.closed


async def test_an_http_1_0_request_is_not_kept_alive() -> None:
    conn, transport = connect(answer())
    conn.data_received(b"GET / HTTP/1.0\r\n\r\n")
    await settle()
    assert transport.sent.startswith(b"HTTP/1.1 200")
    assert transport.closed


async def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    conn, transport = connect(answer())
    conn.data_received(b"POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
    await settle()
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    conn.data_received(b"{}")
    await settle()
    assert transport.writes[1].startswith(b"HTTP/1.1 200")


def error_then_close(transport: RecordingTransport) -> tuple[bytes, str, bool]:
    """The status line, the OpenAI error code of the answer, and whether it closed."""
    head, _, body = transport.sent.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], orjson.loads(body)["error"]["code"], transport.closed


async def test_a_malformed_request_gets_400_in_the_openai_shape_and_a_close() -> None:
    conn, transport = connect(answer())
    conn.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert error_then_close(transport) == (b"HTTP/1.1 400 Bad Request", "invalid_request", True)


async def test_an_app_that_raises_before_answering_gets_a_500_in_the_openai_shape() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise ValueError("boom")

    conn, transport = connect(app)
    conn.data_received(POST)
    await settle()
    answer_500 = (b"HTTP/1.1 500 Internal Server Error", "internal_error", True)
    assert error_then_close(transport) == answer_500


async def test_an_app_that_raises_mid_answer_has_its_connection_closed() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise ValueError("boom")

    conn, transport = connect(app)
    conn.data_received(POST)
    await settle()
    assert transport.sent.endswith(b"4\r\npart\r\n")
    assert transport.closed


async def test_a_client_gone_callback_runs_when_the_connection_drops_mid_answer() -> None:
    gone: list[str] = []
    hold = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        scope["extensions"][CLIENT_GONE](lambda: gone.append("gone"))
        await hold.wait()

    conn, _ = connect(app)
    conn.data_received(POST)
    await settle()
    assert gone == []
    conn.connection_lost(None)
    assert gone == ["gone"]
    hold.set()


async def test_no_client_gone_callback_after_the_answer_is_complete() -> None:
    gone: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["extensions"][CLIENT_GONE](lambda: gone.append("gone"))
        await respond(send)

    conn, _ = connect(app)
    conn.data_received(POST)
    await settle()
    conn.connection_lost(None)
    assert gone == []


async def test_receive_after_the_body_waits_for_the_disconnect() -> None:
    messages: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        messages.append(await receive())
        messages.append(await receive())

    conn, _ = connect(app)
    conn.data_received(POST)
    await settle()
    assert len(messages) == 1
    conn.connection_lost(None)
    await settle()
    assert messages[1] == {"type": "http.disconnect"}


async def test_a_send_waits_while_the_transport_is_over_its_high_water_mark() -> None:
    release = asyncio.Event()
    sent: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"x", "more_body": False})
        sent.append("body")

    conn, _ = connect(app)
    conn.data_received(POST)
    await settle()
    conn.pause_writing()
    release.set()
    await settle()
    assert sent == []
    conn.resume_writing()
    await settle()
    assert sent == ["body"]


async def test_a_large_body_pauses_reading_until_the_app_takes_it() -> None:
    async def never_reads(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(3600)

    conn, transport = connect(never_reads)
    conn.data_received(b"POST / HTTP/1.1\r\ncontent-length: 200000\r\n\r\n" + b"x" * 100_000)
    assert not transport.reading
    conn.connection_lost(None)


@pytest.mark.parametrize("kind", ["http.response.body", "http.response.trailers"])
async def test_a_body_before_the_head_is_refused_with_a_500(kind: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": kind, "body": b"x"})

    conn, transport = connect(app)
    conn.data_received(POST)
    await settle()
    assert transport.sent.startswith(b"HTTP/1.1 500")


async def test_an_answered_request_leaves_no_reference_cycle() -> None:
    """Cycles wait for the collector, whose pauses show in the latency tail."""
    gc.collect()
    gc.disable()
    try:
        conn, _ = connect(answer())
        conn.data_received(POST)
        await settle()
        conn.data_received(POST)  # the connection lets go of the first exchange
        await settle()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = [o for o in gc.garbage if isinstance(o, Exchange)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []
