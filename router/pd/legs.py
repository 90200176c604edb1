"""The legs the router reads itself (prefill, encode): one JSON call to one worker, accounted.

The decode leg is not here: its answer goes to the client, so it runs through the
router's Forwarder (retries before the first byte, streaming relay).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from balancer.fleet import Fleet
from balancer.worker import Outcome, Worker
from router.relay import Relay


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
    fleet: Fleet,
    relay: Relay,
    worker: Worker,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    prompt_tokens: int,
) -> dict[str, Any]:
    """POST ``body`` to ``worker``; the parsed JSON answer, or LegError. Cancel aborts the call."""
    rank = fleet.choose_rank(worker, prompt_tokens=prompt_tokens)
    url = fleet.rank_url(worker, rank) if rank is not None else worker.url
    if rank is not None and worker.spec.dp_mode == "header":
        headers = {**headers, "X-data-parallel-rank": str(rank)}
    ticket = fleet.begin(worker, prompt_tokens=prompt_tokens, dp_rank=rank)
    outcome = Outcome.CLIENT_ABORT
    try:
        try:
            async with asyncio.timeout(timeout_s):
                async with relay.session.post(url + path, data=body, headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
        except TimeoutError:
            outcome = Outcome.TIMEOUT
            raise LegError(
                504, f"{worker.id} did not answer within {timeout_s:g}s", "timeout"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            outcome = Outcome.CONNECT_ERROR
            raise LegError(502, f"{worker.id} unreachable: {exc}", "connect_error") from None
        fleet.first_token(ticket)
        if status != 200:
            outcome = Outcome.SERVER_ERROR if status >= 500 else Outcome.SUCCESS
            raise LegError(status, f"{worker.id} answered HTTP {status}", f"status_{status}", raw)
        outcome = Outcome.SUCCESS
        return _json(raw)
    finally:
        fleet.end(ticket, outcome)


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
