"""Mock engines served by uvicorn in the test's own event loop, for in-process router and
fleet tests that need a faithful engine (adapters, metrics, KV events) behind a real port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import uvicorn

from switchyard.mock.serve import Deployment, build
from switchyard.mock.settings import MockSettings
from tests.support import free_port


class _Server(uvicorn.Server):
    """Signals stay with the test runner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class RunningEngine:
    url: str
    deployment: Deployment
    kv_port: int | None


@contextlib.asynccontextmanager
async def mock_engines(*settings: MockSettings) -> AsyncIterator[list[RunningEngine]]:
    """Each ``MockSettings`` (its port replaced by a free one) served on loopback."""
    servers: list[_Server] = []
    running: list[RunningEngine] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for s in settings:
            port = free_port()
            s = s.model_copy(update={"port": port})
            deployment = build(s)
            (endpoint,) = deployment.endpoints
            for engine in endpoint.engines:
                await engine.start()
            config = uvicorn.Config(
                endpoint.app,
                host="127.0.0.1",
                port=port,
                loop="none",
                lifespan="off",
                access_log=False,
                log_level="warning",
            )
            server = _Server(config)
            servers.append(server)
            tasks.append(asyncio.create_task(server.serve()))
            running.append(RunningEngine(f"http://127.0.0.1:{port}", deployment, s.kv_events_port))
        while not all(srv.started for srv in servers):
            await asyncio.sleep(0.01)
        yield running
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in running:
            for endpoint in r.deployment.endpoints:
                for engine in endpoint.engines:
                    await engine.stop()
            for p in r.deployment.publishers:
                p.close()
            await r.deployment.puller.close()
