"""SGLang's bootstrap port on a prefill mock: ``GET /health`` and ``POST /bootstrap/pull``.

A decode mock pulls a prefill's held KV by bootstrap room through this port, as SGLang's
decode workers reach a prefill worker's bootstrap server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from switchyard.mock.asgi import TEXT, guard, json_body, lifespan, not_found, respond

if TYPE_CHECKING:
    from switchyard.mock.app import EngineServer


class BootstrapServer:
    """The bootstrap port's ASGI app, answering for ``engine_server``'s held KV."""

    def __init__(self, engine_server: EngineServer) -> None:
        self.engine_server = engine_server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await respond(send, 200, b"", TEXT)
            return
        if (scope["method"], scope["path"]) != ("POST", "/bootstrap/pull"):
            await not_found(scope, send)
            return
        es = self.engine_server

        async def work() -> tuple[int, bytes]:
            return await es.bootstrap_pull(await json_body(receive))

        await guard(send, work)
