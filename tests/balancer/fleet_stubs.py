"""Stub engines for balancer tests: stub servers on 127.0.0.1 whose answers we control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.support import eventually_async, free_port


class StubEngine:
    """A worker with ``/health``, ``/v1/models``, ``/metrics`` and a slow ``/work`` endpoint.

    ``health_status`` and ``work_status`` choose the answers; ``stop`` closes the
    listening socket so connections are refused, ``start`` brings it back on the same port.
    """

    def __init__(self, models: tuple[str, ...] = ("m",), metrics: str = "") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.models = list(models)
        self.metrics = metrics
        self.health_status = 200
        self.work_status = 200
        self.work_delay = 0.0
        self.hits = 0
        self.probes = 0
        self._server = StubBackend(self._route, self.port)
        self._routes = {
            "/health": self._health,
            "/v1/models": self._models,
            "/metrics": self._metrics,
            "/work": self._work,
        }

    async def _route(self, request: StubRequest) -> StubReply:
        handler = self._routes.get(request.path) if request.method == "GET" else None
        if handler is None:
            return StubReply.text("Not Found", 404)
        return await handler(request)

    async def _health(self, _: StubRequest) -> StubReply:
        self.probes += 1
        return StubReply.text("ok", self.health_status)

    async def _models(self, _: StubRequest) -> StubReply:
        return StubReply.json({"object": "list", "data": [{"id": m} for m in self.models]})

    async def _metrics(self, _: StubRequest) -> StubReply:
        return StubReply.text(self.metrics)

    async def _work(self, _: StubRequest) -> StubReply:
        self.hits += 1
        if self.work_delay:
            await asyncio.sleep(self.work_delay)
        return StubReply.text("done", self.work_status)

    async def start(self) -> StubEngine:
        await self._server.open()
        return self

    async def stop(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        await self._server.close()


StubFactory = Callable[..., Awaitable[StubEngine]]


async def eventually(
    predicate: Callable[[], bool], timeout: float = 3.0, step: float = 0.01
) -> float:
    """Wait until ``predicate()`` holds; returns the seconds it took (fails on timeout)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await eventually_async(predicate, timeout, step)
    return loop.time() - start
