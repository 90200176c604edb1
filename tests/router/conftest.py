"""Fixtures for router tests: scriptable stub workers (in the test's event loop or in a
thread), routers as real processes, and metrics in multiprocess mode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import values

from switchyard.router.metrics import (
    METRICS_DIR_ENV,
    flush_metric_files_on,
    write_metrics_behind,
)
from tests.router.stub_backend import StubBackend
from tests.support import Server, free_port, one_process

StartRouter = Callable[..., Server]


@pytest.fixture
def stub() -> Iterator[StubBackend]:
    backend = StubBackend().start()
    yield backend
    backend.stop()


@pytest.fixture
def stub2() -> Iterator[StubBackend]:
    backend = StubBackend().start()
    yield backend
    backend.stop()


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[StartRouter]:
    """Start ``switchyard router`` with the given workers and optional YAML config sections."""
    started: list[Server] = []

    def start(*workers: str, config: dict | None = None, args: tuple[str, ...] = ()) -> Server:
        port = free_port()
        argv = ["router", "--port", str(port)]
        for w in workers:
            argv += ["--worker", w]
        if config:
            path = tmp_path / f"router-{port}.yaml"
            path.write_text(yaml.safe_dump(config))
            argv += ["--config", str(path)]
        server = Server([*argv, *one_process(args), *args], port).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def dead_url() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
async def engine() -> AsyncIterator[StubBackend]:
    """A stub worker in the test's event loop, for a router app run in-process."""
    async with StubBackend() as backend:
        yield backend


@pytest.fixture
async def engine2() -> AsyncIterator[StubBackend]:
    async with StubBackend() as backend:
        yield backend


@pytest.fixture
def metric_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Multiprocess mode in this directory, prometheus_client's value class put back after."""
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    original = values.ValueClass
    write_metrics_behind()
    try:
        yield tmp_path
    finally:
        flush_metric_files_on(None)
        values.ValueClass = original
