"""The router server's main loop wakes once a second, and at once when told to exit."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from switchyard.router.mainloop import install, request_exit


class CountingServer(uvicorn.Server):
    """A server whose ticks are counted (``on_tick`` refreshes uvicorn's Date header)."""

    def __init__(self) -> None:
        super().__init__(uvicorn.Config(app=None))
        self.counters: list[int] = []

    async def on_tick(self, counter: int) -> bool:
        self.counters.append(counter)
        return self.should_exit


def ticks_in(seconds: float) -> list[int]:
    async def run() -> list[int]:
        server = CountingServer()
        install(server)
        loop = asyncio.create_task(server.main_loop())
        await asyncio.sleep(seconds)
        loop.cancel()
        return server.counters

    return asyncio.run(run())


def test_the_main_loop_ticks_once_a_second() -> None:
    assert 2 <= len(ticks_in(1.5)) <= 3  # uvicorn's own loop ticks 15 times


def test_every_tick_refreshes_the_date_header() -> None:
    assert all(counter % 10 == 0 for counter in ticks_in(2.5))


def test_an_exit_ends_the_main_loop_at_once() -> None:
    async def run() -> bool:
        server = CountingServer()
        install(server)
        loop = asyncio.create_task(server.main_loop())
        await asyncio.sleep(0.05)
        request_exit(server, signal.SIGTERM, None)
        await asyncio.wait_for(loop, 0.3)
        return server.should_exit

    assert asyncio.run(run())
