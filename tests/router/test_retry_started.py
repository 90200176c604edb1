"""Which failed requests go to another worker: one a worker may have begun generating
is retried only where ``retry.started_requests`` allows; one no worker can have begun,
always."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.balancer.worker import Outcome
from switchyard.net.errors import (
    ConnectError,
    ConnectTimeout,
    InvalidHeader,
    PayloadCut,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    ResponseHeadTooLarge,
    ServerDisconnected,
)
from switchyard.router.relay import UpstreamTimeout
from switchyard.router.upstream import Unsent, may_have_started, outcome_of
from tests.router.inprocess import running_router
from tests.router.stub_backend import StubBackend, StubReply, StubRequest

STARTED = {
    "closed after the request was written": (ServerDisconnected("closed"), True),
    "no head by the deadline": (ReadTimeout("late"), True),
    "a malformed answer": (RemoteProtocolError("bad"), True),
    "an answer head over the cap": (ResponseHeadTooLarge("big"), True),
    "an answer cut after its head": (Unsent(PayloadCut("cut")), True),
    "the relay's first-byte timeout": (UpstreamTimeout("late"), True),
    "refused": (ConnectError("refused"), False),
    "a connect timeout": (ConnectTimeout("slow"), False),
    "no pooled connection by the deadline": (PoolTimeout("busy"), False),
    "a pool timeout seen by the relay": (UpstreamTimeout("busy", maybe_started=False), False),
    "a header refused before writing": (InvalidHeader("x"), False),
}


@pytest.mark.parametrize("exc, started", STARTED.values(), ids=STARTED.keys())
def test_whether_a_failed_request_may_have_started(exc: BaseException, started: bool) -> None:
    assert may_have_started(exc) is started


def test_a_header_refused_before_writing_is_not_held_against_the_worker() -> None:
    assert outcome_of(InvalidHeader("x"), answered=False) is Outcome.CLIENT_ABORT


def test_a_worker_that_breaks_the_protocol_is_a_server_error() -> None:
    assert outcome_of(ResponseHeadTooLarge("big"), answered=False) is Outcome.SERVER_ERROR


def drops_requests() -> tuple[StubBackend, list[str]]:
    """A worker that reads each POST and closes without a byte; the paths it dropped."""
    dropped: list[str] = []

    async def route(request: StubRequest) -> StubReply | None:
        if request.method == "POST":
            dropped.append(request.path)
            raise ConnectionResetError("dropped")
        return None

    return StubBackend(route), dropped


CHAT = (
    "/v1/chat/completions",
    {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
)
EMBED = ("/v1/embeddings", {"model": "stub-model", "input": "hi"})


@pytest.mark.parametrize(
    "mode, route, retried",
    [
        ("embeddings", CHAT, False),
        ("embeddings", EMBED, True),
        ("never", EMBED, False),
        ("always", CHAT, True),
    ],
    ids=["a chat by default", "embeddings by default", "embeddings, never", "a chat, always"],
)
async def test_a_request_the_worker_dropped_after_reading_is_retried_only_as_allowed(
    engine: StubBackend, mode: str, route: tuple[str, dict[str, object]], retried: bool
) -> None:
    path, body = route
    config = {"router": {"retry": {"started_requests": mode}}}
    dropper, dropped = drops_requests()
    async with dropper:
        async with running_router(
            dropper.url, engine.url, config=config, policy="round_robin"
        ) as router:
            statuses = [(await router.post(path, json=body)).status_code for _ in range(2)]
    assert dropped == [path]  # written once, to the worker that dropped it
    assert sorted(statuses) == ([200, 200] if retried else [200, 502])
    assert engine.state.requests == (2 if retried else 1)


async def test_a_refused_worker_is_retried_whatever_the_setting(engine: StubBackend) -> None:
    gone = StubBackend()
    await gone.open()
    await gone.close()  # refuses from now on
    config = {
        "router": {"retry": {"started_requests": "never"}},
        "balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000},
    }
    async with running_router(gone.url, engine.url, config=config, policy="round_robin") as r:
        statuses = [(await r.post(CHAT[0], json=CHAT[1])).status_code for _ in range(2)]
    assert statuses == [200, 200]


async def _two_chats_never_retrying_started(dying: StubBackend, engine: StubBackend) -> list[int]:
    """Two chats, round robin from ``dying`` to ``engine``, with ``started_requests`` never:
    only a worker proved gone has its chat retried."""
    config = {
        "router": {"retry": {"started_requests": "never"}},
        "balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000},
    }
    async with dying:
        async with running_router(dying.url, engine.url, config=config, policy="round_robin") as r:
            return [(await r.post(CHAT[0], json=CHAT[1])).status_code for _ in range(2)]


async def test_a_chat_whose_worker_died_after_reading_it_goes_to_another(
    engine: StubBackend,
) -> None:
    """A dead engine cannot go on generating: its port refusing a new connection proves it
    gone, and the request is safe to run elsewhere whatever ``started_requests`` says."""
    dying: StubBackend

    async def route(request: StubRequest) -> StubReply | None:
        if request.method == "POST":
            server = dying._server
            assert server is not None
            server.close()  # the process ends: its port refuses from now on
            raise ConnectionResetError("died")
        return None

    dying = StubBackend(route)
    assert await _two_chats_never_retrying_started(dying, engine) == [200, 200]
    assert engine.state.requests == 2


class _SlowToDie(StubBackend):
    """A killed engine whose last process still holds the listening socket: its port takes
    ``accepting`` more connections once the request broke, then refuses."""

    accepting: int | None = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.accepting is not None:
            self.accepting -= 1
            if self.accepting == 0 and self._server is not None:
                self._server.close()  # the last process has ended
        await super()._connection(reader, writer)


async def test_a_worker_whose_port_takes_a_while_to_refuse_is_still_judged_gone(
    engine: StubBackend,
) -> None:
    """A killed engine's processes end one by one: a port that accepts the first probes and
    then refuses is a dead engine, and its chat goes to another worker."""
    dying: _SlowToDie

    async def route(request: StubRequest) -> StubReply | None:
        if request.method == "POST":
            dying.accepting = 6  # more probes than the first few
            raise ConnectionResetError("died")
        return None

    dying = _SlowToDie(route)
    assert await _two_chats_never_retrying_started(dying, engine) == [200, 200]
    assert engine.state.requests == 2
    assert dying.accepting == 0  # the probes went on until the port refused
