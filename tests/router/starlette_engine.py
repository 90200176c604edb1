"""An engine on vLLM's own HTTP stack (uvicorn with httptools on uvloop, starlette's
StreamingResponse over an async generator), run in a thread: what that stack does with a
stream its reader stopped reading and then abandoned.

vLLM 0.32 aborts a request when the disconnect cancels its stream's generator. Each stream
stays referenced (``generators``), so only that cancellation, not a garbage collection,
can end one early.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.support import eventually, free_port

_CHUNK = b'data: {"choices": [{"delta": {"content": "%s"}}]}\n\n' % (b"x" * 4000)


@dataclass
class StreamCounts:
    aborted: int = 0
    finished: int = 0
    generators: list[AsyncIterator[bytes]] = field(default_factory=list)


class StarletteEngine:
    def __init__(self, chunks: int = 20_000, step_s: float = 0.002, per_step: int = 32) -> None:
        self.counts = StreamCounts()
        self.chunks, self.step_s, self.per_step = chunks, step_s, per_step
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        routes = [
            Route("/health", self._health),
            Route("/v1/models", self._models),
            Route("/v1/completions", self._stream, methods=["POST"]),
        ]
        app = Starlette(routes=routes)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> StarletteEngine:
        self._thread.start()
        eventually(lambda: self._server.started, 10, message="the engine did not start")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({})

    async def _models(self, request: Request) -> JSONResponse:
        model = {"id": "stub-model", "object": "model", "owned_by": "stub"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _stream(self, request: Request) -> StreamingResponse:
        await request.body()
        tokens = self._tokens()
        self.counts.generators.append(tokens)
        return StreamingResponse(tokens, media_type="text/event-stream")

    async def _tokens(self) -> AsyncIterator[bytes]:
        counts = self.counts
        try:
            for i in range(self.chunks):
                if not i % self.per_step:
                    await asyncio.sleep(self.step_s)  # the next decode step
                yield _CHUNK
        except asyncio.CancelledError:
            counts.aborted += 1
            raise
        counts.finished += 1
