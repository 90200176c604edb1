"""The legs the router reads itself (prefill, encode): one JSON call to one worker, accounted.

The decode leg is not here: its answer goes to the client, so it runs through the
router's Forwarder (retries before the first byte, streaming relay).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Outcome, Worker
from switchyard.net.errors import TransportError
from switchyard.router.relay import Relay
from switchyard.router.upstream import Call

if TYPE_CHECKING:
    from switchyard.router.tracing import Tracing


class LegError(Exception):
    """A leg failed. ``retryable`` failures may go to another worker; the rest reach the client."""

    def __init__(self, status: int, message: str, reason: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.body = body

    @property
    def retryable(self) -> bool:
        return self.body is None or self.status >= 500 or self.status == 429


async def call_json(
    fleet: FleetView,
    relay: Relay,
    worker: Worker,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    prompt_tokens: int,
    tracing: Tracing | None = None,
) -> dict[str, Any]:
    """POST ``body`` to ``worker``; the parsed JSON answer, or LegError. Cancel aborts the call.

    ``tracing``: the call is a CLIENT span (``router.upstream.Call``)."""
    rank = fleet.choose_rank(worker, prompt_tokens=prompt_tokens)
    call = Call(fleet, worker, rank, path, headers, prompt_tokens=prompt_tokens, tracing=tracing)
    try:
        with call:
            async with asyncio.timeout(timeout_s):
                resp = await relay.pool.post(call.url, body, call.headers)
                try:
                    status = resp.status
                    call.head(status)
                    raw = await resp.read()
                finally:
                    resp.close()
            fleet.first_token(call.ticket)
    except (TimeoutError, TransportError, OSError) as exc:
        raise _failed(worker, call.outcome, exc, timeout_s) from None
    if status != 200:
        raise LegError(status, f"{worker.id} answered HTTP {status}", f"status_{status}", raw)
    return _json(raw)


def _failed(worker: Worker, outcome: Outcome, exc: BaseException, timeout_s: float) -> LegError:
    """The LegError of a call that raised; its reason is the outcome the fleet counted."""
    if outcome is Outcome.TIMEOUT:
        return LegError(504, f"{worker.id} did not answer within {timeout_s:g}s", str(outcome))
    if outcome is Outcome.CONNECT_ERROR:
        return LegError(502, f"{worker.id} unreachable: {exc}", str(outcome))
    return LegError(502, f"{worker.id} failed while answering: {exc}", str(outcome))


def _json(raw: bytes) -> dict[str, Any]:
    """The answer as an object; an SSE answer (a streamed leg) yields its last JSON event."""
    if raw.startswith(b"data:") or b"\ndata:" in raw[:64]:
        last: dict[str, Any] = {}
        for line in raw.splitlines():
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    last = event
        return last
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}
