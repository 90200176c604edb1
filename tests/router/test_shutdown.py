"""Graceful shutdown: on SIGTERM /ready goes false, in-flight requests finish or end cleanly
within the shutdown timeout, and the router exits."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from switchyard.router.server import EXIT_RESERVE_S, SUPERVISOR_RESERVE_S, graceful_window_s
from switchyard.router.settings import RouterSettings, Timeouts
from tests.router.stub_backend import StubBackend
from tests.support import Server, eventually, free_port, one_process

StartRouter = Callable[..., Server]


@pytest.fixture
def start_router() -> Iterator[StartRouter]:
    started: list[Server] = []

    def start(worker: str, *args: str, own_group: bool = False) -> Server:
        port = free_port()
        argv = ["router", "--port", str(port), "--worker", worker, *one_process(args), *args]
        server = Server(argv, port, start_timeout_s=90, own_group=own_group).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class InFlight:
    """One completion sent in a thread; ``result`` is its response or the exception."""

    def __init__(self, url: str) -> None:
        self.result: httpx.Response | Exception | None = None
        self._thread = threading.Thread(target=self._send, args=(url,), daemon=True)
        self._thread.start()

    def _send(self, url: str) -> None:
        try:
            self.result = httpx.post(
                url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}, timeout=60
            )
        except httpx.HTTPError as exc:
            self.result = exc

    def wait(self) -> httpx.Response | Exception | None:
        self._thread.join(30)
        return self.result


def terminate(router: Server, *, group: bool = False) -> float:
    """SIGTERM the router; returns when it was sent."""
    assert router.proc is not None
    if group:
        os.killpg(router.proc.pid, signal.SIGTERM)
    else:
        router.proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def exit_time(router: Server, timeout_s: float = 60) -> float:
    assert router.proc is not None
    router.proc.wait(timeout_s)
    return time.monotonic()


def test_a_held_request_ends_in_503_shutting_down_and_the_router_exits_in_time(
    start_router: StartRouter, stub: StubBackend
) -> None:
    stub.state.hang = True
    router = start_router(stub.url, "--timeouts-shutdown-s", "1")
    held = InFlight(router.url)
    eventually(lambda: stub.state.requests == 1, 30)
    sent = terminate(router)
    exited = exit_time(router)
    assert exited - sent < 1 + 5
    result = held.wait()
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 503
    assert result.json()["error"]["code"] == "shutting_down"
    # uvicorn re-raises the signal once shut down: ended by SIGTERM, not killed or crashed.
    assert router.proc is not None and router.proc.returncode in (0, -signal.SIGTERM)


def test_an_in_flight_request_within_the_timeout_is_answered() -> None:
    backend = StubBackend()
    backend.state.delay_s = 1.5  # the router's SIGTERM arrives while it waits
    backend.start()
    port = free_port()
    router = Server(
        ["router", "--port", str(port), "--worker", backend.url, *one_process()]
        + ["--timeouts-shutdown-s", "20"],
        port,
        start_timeout_s=90,
    ).start()
    try:
        held = InFlight(router.url)
        eventually(lambda: backend.state.requests == 1, 30)
        sent = terminate(router)
        result = held.wait()
        assert isinstance(result, httpx.Response), result
        assert result.status_code == 200
        assert exit_time(router) - sent < 20
    finally:
        router.stop()
        backend.stop()


def test_ready_goes_false_while_the_router_drains(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, "--timeouts-drain-s", "6")
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200, 30)
    terminate(router)
    ready = httpx.get(router.url + "/ready", timeout=5)
    assert ready.status_code == 503
    assert ready.json()["status"] == "shutting_down"
    exit_time(router)
    with pytest.raises(httpx.ConnectError):
        httpx.get(router.url + "/health", timeout=5)


def test_several_processes_exit_within_the_shutdown_timeout_answering_503(
    start_router: StartRouter, stub: StubBackend
) -> None:
    """The whole group signalled (each process gets SIGTERM twice: directly and from the
    parent): the held request still ends in a clean 503, within the timeout."""
    stub.state.hang = True
    router = start_router(
        stub.url, "--processes", "2", "--timeouts-shutdown-s", "1", own_group=True
    )
    held = InFlight(router.url)
    eventually(lambda: stub.state.requests == 1, 30)
    sent = terminate(router, group=True)
    assert exit_time(router) - sent < 1 + 10
    result = held.wait()
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 503
    assert result.json()["error"]["code"] == "shutting_down"


def _ready_status(url: str) -> int | str:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_several_processes_answer_ready_503_while_they_drain(
    start_router: StartRouter, stub: StubBackend
) -> None:
    """SIGTERM to the parent only (as Kubernetes sends it): it passes the signal on, and
    every process answers /ready 503 through the drain while still serving requests."""
    router = start_router(stub.url, "--processes", "2", "--timeouts-drain-s", "10", own_group=True)
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200, 30)
    terminate(router)
    time.sleep(1.0)  # the parent passes signals on every 0.5 s
    assert [_ready_status(router.url) for _ in range(6)] == [503] * 6
    served = httpx.post(
        router.url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}, timeout=10
    )
    assert served.status_code == 200
    exit_time(router)


def test_the_graceful_window_ends_a_second_before_the_timeout_counted_from_the_signal() -> None:
    settings = RouterSettings(timeouts=Timeouts(shutdown_s=30, drain_s=4), processes=1)
    assert graceful_window_s(settings) == 30 - 4 - EXIT_RESERVE_S


def test_several_processes_reserve_time_for_the_supervisor_as_well() -> None:
    settings = RouterSettings(timeouts=Timeouts(shutdown_s=30), processes=2)
    assert graceful_window_s(settings) == 30 - EXIT_RESERVE_S - SUPERVISOR_RESERVE_S


def test_a_timeout_shorter_than_the_reserve_cancels_at_once_rather_than_never() -> None:
    """uvicorn reads a window of 0 as no limit at all."""
    assert 0 < graceful_window_s(RouterSettings(timeouts=Timeouts(shutdown_s=0.5))) < 0.1
