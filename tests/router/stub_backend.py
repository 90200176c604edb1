"""A scriptable OpenAI-ish backend for router tests, served by aiohttp in a thread.

The mock engine is the realistic backend; this one exists to control exactly what
the router sees (status codes, hangs, slow streams) and to timestamp when the
router closed a connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from tests.support import free_port


@dataclass
class StubState:
    status: int = 200
    hang: bool = False
    delay_s: float = 0.0  # before answering
    # Close the connection after this many chunks (streams) or half the body (others).
    cut_after_chunks: int | None = None
    chunk_interval_s: float = 0.05
    models: list[str] = field(default_factory=lambda: ["stub-model"])
    requests: int = 0
    last_headers: dict[str, str] = field(default_factory=dict)
    last_body: bytes = b""
    disconnected_at: list[float] = field(default_factory=list)


class StubBackend:
    def __init__(self) -> None:
        self.state = StubState()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> StubBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        if self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/embeddings", self._completion)
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "stub"} for m in self.state.models]
        return web.json_response({"object": "list", "data": data})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        s = self.state
        s.requests += 1
        s.last_headers = {k.lower(): v for k, v in request.headers.items()}
        raw = s.last_body = await request.read()
        if s.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(s.delay_s)
        if s.status != 200:
            return web.json_response(
                {"error": {"message": "stub failure", "type": "server_error", "code": s.status}},
                status=s.status,
            )
        body = orjson.loads(raw)  # not last_body: a concurrent request may have replaced it
        if not body.get("stream"):
            answer = {"id": "cmpl-stub", "object": "text_completion", "echo": body}
            if s.cut_after_chunks is None:
                return web.json_response(answer)
            return await self._cut_whole(request, orjson.dumps(answer))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(100_000):
                if i == s.cut_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                await resp.write(b'data: {"i": %d}\n\n' % i)
                await asyncio.sleep(s.chunk_interval_s)
        except (asyncio.CancelledError, ConnectionResetError):
            s.disconnected_at.append(time.monotonic())
            raise
        return resp

    async def _cut_whole(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Announce the whole body, send half of it, then drop the connection."""
        resp = web.StreamResponse(
            headers={"Content-Type": "application/json", "Content-Length": str(len(body))}
        )
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        assert request.transport is not None
        request.transport.close()
        return resp
