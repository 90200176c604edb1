"""How a call to a worker ended, as the fleet's passive health counts it, on every path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, Worker, WorkerSpec
from switchyard.net.errors import (
    ConnectError,
    ConnectTimeout,
    InvalidURL,
    PayloadCut,
    ReadTimeout,
    ServerDisconnected,
)
from switchyard.router.errors import RouterError
from switchyard.router.forward import Forwarder
from switchyard.router.metrics import RouterMetrics
from switchyard.router.pd.legs import LegError, call_json
from switchyard.router.relay import Relay
from switchyard.router.request import COMPLETIONS, parse
from switchyard.router.scheduler.framework import Context
from switchyard.router.upstream import outcome_of
from tests.support import free_port

pytestmark = pytest.mark.timeout(30)

BODY = b'{"model": "m", "prompt": "hi", "max_tokens": 4}'
# A head promising 100 bytes, 10 of them, then the connection closes.
BROKEN_ANSWER = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"partial"'
)


async def _broken_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(BROKEN_ANSWER)
    await writer.drain()
    writer.close()


@pytest.fixture
async def broken_url() -> AsyncIterator[str]:
    """A worker that answers a head and then breaks off its answer mid-body."""
    port = free_port()
    server = await asyncio.start_server(_broken_worker, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    relay = Relay(connect_timeout_s=1.0, first_byte_timeout_s=2.0, idle_timeout_s=2.0)
    await relay.start()
    yield relay
    await relay.stop()


async def _unified(fleet: Fleet, relay: Relay, worker: Worker) -> None:
    """One attempt through the router's Forwarder: a failure after the head reaches the
    client as the upstream error, one before it as the router's 502."""
    forwarder = Forwarder(
        fleet, relay, RouterMetrics(), max_attempts=1, backoff_s=0.0, backoff_max_s=0.0
    )

    async def send(_: MutableMapping[str, Any]) -> None:
        return None

    req = parse(COMPLETIONS, BODY, None)
    with pytest.raises((PayloadCut, RouterError)):
        await forwarder.forward(req, Context(model="m"), [worker], {}, b"rid", send, 0.0)


async def _pd_leg(fleet: Fleet, relay: Relay, worker: Worker) -> None:
    """One P/D leg (prefill or encode) call."""
    with pytest.raises(LegError):
        await call_json(fleet, relay, worker, COMPLETIONS, BODY, {}, timeout_s=2.0, prompt_tokens=4)


PATHS = pytest.mark.parametrize("path", [_unified, _pd_leg], ids=["unified", "pd_leg"])


@PATHS
async def test_an_answer_broken_off_mid_body_is_a_server_error_on_every_path(
    broken_url: str, relay: Relay, path: Any
) -> None:
    fleet = Fleet(BalancerSettings(), [WorkerSpec(broken_url, models=["m"])])
    (worker,) = fleet.workers()
    await path(fleet, relay, worker)
    assert worker.last_error == str(Outcome.SERVER_ERROR)
    assert worker.breaker.failures == 1
    assert worker.inflight == 0


@PATHS
async def test_a_refused_connection_is_a_connect_error_on_every_path(
    relay: Relay, path: Any
) -> None:
    fleet = Fleet(BalancerSettings(), [WorkerSpec(f"http://127.0.0.1:{free_port()}")])
    (worker,) = fleet.workers()
    await path(fleet, relay, worker)
    assert worker.last_error == str(Outcome.CONNECT_ERROR)
    assert worker.inflight == 0


@pytest.mark.parametrize(
    ("exc", "answered", "outcome"),
    [
        (ConnectError("refused"), False, "connect_error"),
        (ConnectionResetError(), False, "connect_error"),
        (ServerDisconnected("closed"), False, "connect_error"),
        (InvalidURL("ftp://x"), False, "server_error"),
        (PayloadCut("cut"), True, "server_error"),
        (ServerDisconnected("closed"), True, "server_error"),
        (ConnectTimeout("connect"), False, "timeout"),
        (ReadTimeout("head"), False, "timeout"),
        (TimeoutError(), False, "timeout"),
        (TimeoutError(), True, "timeout"),
        (asyncio.CancelledError(), True, "client_abort"),
        (asyncio.CancelledError(), False, "client_abort"),
    ],
)
def test_a_failure_is_a_connect_error_only_before_the_response_head(
    exc: BaseException, answered: bool, outcome: str
) -> None:
    assert outcome_of(exc, answered) == outcome
