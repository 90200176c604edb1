"""Stub engines for balancer tests: real aiohttp servers on 127.0.0.1 whose answers we control."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

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
        self._runner: web.AppRunner | None = None

    async def _health(self, _: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(status=self.health_status, text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _work(self, _: web.Request) -> web.Response:
        self.hits += 1
        if self.work_delay:
            await asyncio.sleep(self.work_delay)
        return web.Response(status=self.work_status, text="done")

    async def start(self) -> StubEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/work", self._work)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


StubFactory = Callable[..., Awaitable[StubEngine]]


async def eventually(
    predicate: Callable[[], bool], timeout: float = 3.0, step: float = 0.01
) -> float:
    """Wait until ``predicate()`` holds; returns the seconds it took (fails on timeout)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await eventually_async(predicate, timeout, step)
    return loop.time() - start
