"""Fixtures for balancer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.balancer.fleet_stubs import StubEngine, StubFactory


@pytest.fixture
async def stub_engine() -> AsyncIterator[StubFactory]:
    started: list[StubEngine] = []

    async def make(models: tuple[str, ...] = ("m",), metrics: str = "") -> StubEngine:
        stub = await StubEngine(models, metrics).start()
        started.append(stub)
        return stub

    yield make
    for stub in started:
        await stub.stop()
