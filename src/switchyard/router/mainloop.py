"""The router server's main loop: one wake-up a second, not uvicorn's ten.

uvicorn's ``Server.main_loop`` sleeps 0.1 s at a time to see whether it should exit and
refreshes the Date header every tenth time. Each wake-up of an idle loop costs CPU, and
ten a second per process were a large part of an idle router's CPU
(``bench.router_cpu --idle``). Here the loop waits a second for the Date header, and an
exit asked for through ``request_exit`` wakes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from types import FrameType

import uvicorn

_WAKE: weakref.WeakKeyDictionary[uvicorn.Server, asyncio.Event] = weakref.WeakKeyDictionary()


def install(server: uvicorn.Server) -> None:
    """Give ``server`` this main loop (before it starts serving)."""
    wake = _WAKE[server] = asyncio.Event()

    async def main_loop() -> None:
        counter = 0
        while not await server.on_tick(counter):
            counter += 10  # ``on_tick`` refreshes the Date header when counter % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), 1.0)
            wake.clear()

    server.main_loop = main_loop  # type: ignore[method-assign]


def request_exit(server: uvicorn.Server, sig: int, frame: FrameType | None) -> None:
    """uvicorn's ``handle_exit``, then wake the main loop so it acts on it now."""
    uvicorn.Server.handle_exit(server, sig, frame)
    wake = _WAKE.get(server)
    if wake is not None:
        wake.set()
