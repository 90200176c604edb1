"""Mock P/D fleets and a router in front of them, all in the test's own event loop.

The mock engines are ``switchyard mock``'s own deployment (``switchyard.mock.serve.build``),
served by uvicorn on loopback in this loop, since a decode engine pulls KV from a prefill
engine over HTTP; the router is the app ``switchyard router`` builds
(``tests.router.inprocess``). Each mock counts the generation requests it was sent, so a
test states how many attempts a leg took instead of how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from switchyard.loadtest.prom import values
from switchyard.mock.app import EngineServer
from switchyard.mock.serve import build
from switchyard.mock.settings import MockSettings
from switchyard.mock.tokenizer import ModelTokenizer
from tests.router.inprocess import BASE_URL, InProcessRouter, running_router
from tests.support import eventually_async, free_port

MODEL = "mock-model"
LONG_PROMPT = "disaggregated prefill across the fleet " * 20
GENERATE = {"/v1/completions", "/v1/chat/completions"}


def spec(url: str, **options: object) -> str:
    """A worker URL with its model declared, so it routes before the first /v1/models poll."""
    extra = "".join(f";{k}={v}" for k, v in options.items())
    return f"{url};models={MODEL}{extra}"


@functools.cache
def _tokenizer(directory: str) -> ModelTokenizer:
    """One tokenizer for every mock of a session: loading it is most of a mock's start."""
    return ModelTokenizer(directory)


class _Counted:
    """The engine's ASGI app, counting the generation requests that reach it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.generations = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATE:
            self.generations += 1
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves the test's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Mock:
    """One mock engine served in this loop."""

    def __init__(self, settings: MockSettings, app: EngineServer, counted: _Counted) -> None:
        self.settings = settings
        self.app = app
        self.url = f"http://127.0.0.1:{settings.port}"
        self.bootstrap_port = settings.bootstrap_port
        self.images_encoded = 0  # by this engine's own simulated vision encoder
        self._counted = counted
        encode = app.encoder.delay

        async def counted_encode(num_images: int) -> None:
            self.images_encoded += num_images
            await encode(num_images)

        app.encoder.delay = counted_encode  # type: ignore[method-assign]

    @property
    def generations(self) -> int:
        """Completion and chat requests this engine was sent (each leg is one)."""
        return self._counted.generations

    def faults(self, kind: str) -> int:
        """How many times this engine injected fault ``kind`` (error, hang...)."""
        return self.app.metrics.faults.get(kind, 0)

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(self.url + "/metrics")).text
        return sum(values(text, name, **labels))


@contextlib.asynccontextmanager
async def running_mock(*, speed: float = 20, **settings: Any) -> AsyncIterator[Mock]:
    """``switchyard mock --speed 20 [--field value...]`` in this loop, on a free port (and a
    free bootstrap port for an SGLang prefill engine)."""
    if settings.get("flavor") == "sglang" and settings.get("role") == "prefill":
        settings.setdefault("bootstrap_port", free_port())
    s = MockSettings(port=free_port(), speed=speed, **settings)
    deployment = build(s, _tokenizer(s.tokenizer))
    engine = deployment.endpoints[0].app
    counted = _Counted(engine)
    servers = [
        _Server(
            uvicorn.Config(
                counted if e.app is engine else e.app,
                host=s.host,
                port=e.port,
                http="httptools",
                loop="none",
                lifespan="off",
                log_level="warning",
                timeout_graceful_shutdown=0,  # the router is gone: what is left was abandoned
            )
        )
        for e in deployment.endpoints
    ]
    engines = [eng for e in deployment.endpoints for eng in e.engines]
    for eng in engines:
        await eng.start()
    serving = [asyncio.create_task(srv.serve()) for srv in servers]
    try:
        await eventually_async(
            lambda: all(srv.started for srv in servers) or any(t.done() for t in serving)
        )
        assert all(srv.started for srv in servers), [t for t in serving if t.done()]
        yield Mock(s, engine, counted)
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*serving, return_exceptions=True)
        for eng in engines:
            await eng.stop()
        await deployment.puller.close()


class PDRouter:
    """A P/D router app in this loop, with the official openai client in front of it."""

    def __init__(self, router: InProcessRouter) -> None:
        self.router = router
        self.app = router.app
        self.openai = openai.AsyncOpenAI(
            base_url=BASE_URL + "/v1", api_key="unused", max_retries=0, http_client=router.client
        )

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(values((await self.router.get("/metrics")).text, name, **labels))

    async def placed(self) -> None:
        """Until the placements the router records once an answer started are in: a next
        turn sent at once would otherwise overtake them, as a client's round trip does not."""
        kv = self.app.kv
        if kv is not None:
            await asyncio.gather(*list(kv._pending))


def _worker(w: Mock | str) -> str:
    """A mock as a worker spec (its model declared, its bootstrap port if it has one)."""
    if isinstance(w, str):
        return w
    if w.bootstrap_port is not None:
        return spec(w.url, bootstrap=w.bootstrap_port)
    return spec(w.url)


@contextlib.asynccontextmanager
async def pd_router(
    protocol: str,
    *,
    prefill: list[Mock | str] = (),  # type: ignore[assignment]
    decode: list[Mock | str] = (),  # type: ignore[assignment]
    encode: list[Mock | str] = (),  # type: ignore[assignment]
    pd: dict[str, object] | None = None,
    **flags: Any,
) -> AsyncIterator[PDRouter]:
    """``switchyard router --pd-protocol P --prefill... --decode... --encode...`` in this
    loop; ``pd`` is the config's ``router.pd`` section, ``flags`` other settings by name."""
    section = {
        "protocol": protocol,
        "prefill": [_worker(w) for w in prefill],
        "decode": [_worker(w) for w in decode],
        "encode": [_worker(w) for w in encode],
        **(pd or {}),
    }
    async with running_router(config={"router": {"pd": section}}, **flags) as router:
        yield PDRouter(router)


@contextlib.asynccontextmanager
async def vllm_pair(
    *,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    pd: dict[str, object] | None = None,
    **flags: Any,
) -> AsyncIterator[tuple[PDRouter, Mock, Mock]]:
    """One vLLM prefill mock, one decode mock and a router in front: (router, prefill, decode);
    ``prefill``/``decode`` are the mocks' extra settings."""
    async with (
        running_mock(role="prefill", **(prefill or {})) as p,
        running_mock(role="decode", **(decode or {})) as d,
        pd_router("vllm", prefill=[p], decode=[d], pd=pd, **flags) as front,
    ):
        yield front, p, d
