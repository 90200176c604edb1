"""The router app is a plain ASGI app: under a server without our protocol's extensions
it answers, and a client that goes away still has its request cancelled at the worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import orjson
import uvicorn
from starlette.types import Message

from switchyard.router.server import build_app
from switchyard.router.settings import RouterSettings
from tests.router.inprocess import running_router
from tests.router.stub_backend import StubBackend
from tests.support import eventually_async, free_port

BODY = orjson.dumps({"model": "stub-model", "prompt": "hi"})
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def test_a_disconnect_seen_through_receive_cancels_the_request(
    engine: StubBackend,
) -> None:
    engine.state.hang = True
    gone = asyncio.Event()
    sent: list[Message] = []
    messages = [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    async with running_router(engine.url) as router:
        request = asyncio.create_task(router.app(scope, receive, send))
        await eventually_async(lambda: engine.state.requests == 1)
        gone.set()
        await asyncio.wait_for(request, 10)
        await eventually_async(lambda: engine.state.disconnected_at)
        assert router.app.metrics.client_disconnects._value.get() == 1
    assert sent == []  # nothing is answered to a client that is gone


@contextlib.asynccontextmanager
async def under_uvicorn_h11(worker: str) -> AsyncIterator[str]:
    """The router app served by uvicorn's own h11 protocol, lifespan and all."""
    port = free_port()
    app = build_app(RouterSettings.load(None, workers=[worker]))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="h11", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        await eventually_async(lambda: server.started or serving.done())
        assert server.started, serving
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def test_the_app_answers_under_another_asgi_server(engine: StubBackend) -> None:
    async with under_uvicorn_h11(engine.url) as url, httpx.AsyncClient() as client:
        resp = await client.post(url + "/v1/completions", content=BODY)
    assert resp.status_code == 200
    assert resp.json()["echo"] == orjson.loads(BODY)
    assert resp.headers["x-switchyard-worker"] == engine.url


async def test_a_client_gone_under_another_asgi_server_aborts_the_worker(
    engine: StubBackend,
) -> None:
    engine.state.hang = True
    async with under_uvicorn_h11(engine.url) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(REQUEST)
        await eventually_async(lambda: engine.state.requests == 1)
        writer.close()
        assert await eventually_async(
            lambda: engine.state.disconnected_at, message="worker aborted"
        )
