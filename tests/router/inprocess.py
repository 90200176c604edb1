"""The router app in the test's own event loop: built from settings as ``switchyard router``
builds it, its ASGI lifespan run, requests sent over ``httpx.ASGITransport``.

A request-level test then needs no process and no port of the router's, only the
workers' (the router's upstream client speaks HTTP/1.1 over sockets, so a stub worker
listens on loopback in the same loop: ``tests.router.stub_backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import yaml
from starlette.types import ASGIApp, Message

from switchyard.router.app import RouterApp
from switchyard.router.server import build_app
from switchyard.router.settings import RouterSettings

BASE_URL = "http://router.test"


class LifespanFailed(RuntimeError):
    """The app answered ``lifespan.startup.failed``."""


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Startup before the body, shutdown after it, over the ASGI lifespan protocol
    (``httpx.ASGITransport`` sends only ``http`` scopes)."""
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()

    async def send(message: Message) -> None:
        await from_app.put(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    running = asyncio.create_task(app(scope, to_app.get, send))

    async def answer(to: str) -> Message:
        await to_app.put({"type": f"lifespan.{to}"})
        reply = asyncio.create_task(from_app.get())
        await asyncio.wait({reply, running}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            running.result()  # raises what the app raised
            raise LifespanFailed(f"the app returned without answering lifespan.{to}")
        return reply.result()

    try:
        started = await answer("startup")
        if started["type"] != "lifespan.startup.complete":
            raise LifespanFailed(started.get("message", started["type"]))
        yield
        stopped = await answer("shutdown")
        assert stopped["type"] == "lifespan.shutdown.complete", stopped
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


class InProcessRouter:
    """A started router app and a client that reaches it with no server between."""

    def __init__(self, app: RouterApp, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.client.post(path, **kwargs)

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.client.get(path, **kwargs)


@contextlib.asynccontextmanager
async def running_router(
    *workers: str, config: dict[str, Any] | None = None, **flags: Any
) -> AsyncIterator[InProcessRouter]:
    """``switchyard router --worker W... [--config C] [--flag value...]`` in this loop.

    ``config`` is the YAML file's content (``router:``/``balancer:`` sections); ``flags``
    are settings by field name, as the command's flags give them."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(config or {}, file)
        file.flush()
        settings = RouterSettings.load(file.name, workers=list(workers), **flags)
        app = build_app(settings, file.name)
    async with lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield InProcessRouter(app, client)
