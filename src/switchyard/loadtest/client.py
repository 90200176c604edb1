"""Open-loop replay: every request leaves at its arrival time, whether or not others returned.

A closed loop (N users waiting for answers) slows down with the system under test and
hides overload; an open loop keeps offering the workload's rate, so queueing shows up
in TTFT where it belongs. Each request streams (SSE) with ``include_usage`` so the
engine's own prompt and cached token counts come back with the answer.

Requests go through the router's own HTTP client (``switchyard.net.httpclient``): the
load generator shares the machine with what it measures, so its cost per chunk is kept
as low as the router's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.loadtest.workload import Workload
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool, Response

_HEADERS = {"content-type": "application/json"}


@dataclass
class Result:
    """What one request measured (seconds, wall clock, relative to the replay start)."""

    index: int
    sent_s: float
    tenant: str = ""  # the request's, so results can be split by tenant
    ok: bool = False
    status: int = 0
    error: str = ""
    # A refusal's ``Retry-After`` and ``x-switchyard-reason`` headers, as sent.
    retry_after: str = ""
    reason: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None  # to the whole answer, an HTTP error's included
    done_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def _lines(resp: Response) -> AsyncIterator[bytes]:
    """The body's lines as they arrive (an SSE event is a line)."""
    rest = b""
    while chunk := await resp.readany():
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def _one(
    pool: ConnectionPool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    res: Result,
    timeout_s: float,
) -> None:
    """Send one request and measure its answer into ``res``, all within ``timeout_s``."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            r = await pool.post(url, body, headers)
            try:
                if not await _read(r, res, start):
                    if res.status:
                        res.e2e_s = time.perf_counter() - start
                    return
            finally:
                r.close()
        res.e2e_s = time.perf_counter() - start
        res.done_s = res.sent_s + res.e2e_s
        res.ok = res.ttft_s is not None
        if not res.ok:
            res.error = "stream ended without a token"
    except (TimeoutError, TransportError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]


async def _read(r: Response, res: Result, start: float) -> bool:
    """Read the answer's events into ``res`` as they arrive; False if it was an error."""
    res.status = r.status
    if r.status != 200:
        for name, value in r.raw_headers:
            lower = name.lower()
            if lower == b"retry-after":
                res.retry_after = value.decode("latin-1")
            elif lower == b"x-switchyard-reason":
                res.reason = value.decode("latin-1")
        text = (await r.read()).decode("utf-8", "replace")
        res.error = f"HTTP {r.status}: {text[:200]}"
        return False
    last: float | None = None
    async for raw in _lines(r):
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            res.error = str(chunk["error"])[:200]
            return False
        now = time.perf_counter()
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
        usage = chunk.get("usage")
        if usage:
            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
    return True


async def replay(
    base_url: str,
    workload: Workload,
    model: str,
    timeout_s: float = 120.0,
    on_done: Callable[[Result], None] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> list[Result]:
    """Send every request of ``workload`` to ``base_url`` at its arrival time; all results.
    Each request, connecting included, has ``timeout_s`` in all. ``extra_body``: more
    fields for every request (``ignore_eos`` for a random-weight model, whose answer may
    otherwise end at once with no token to time)."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    extra = extra_body or {}
    bodies = [orjson.dumps({**r.body(model), **extra}) for r in workload.requests]
    keyed = {key: {**_HEADERS, "authorization": f"Bearer {key}"} for key in _keys(workload)}
    results: list[Result] = []
    pool = ConnectionPool(connect_timeout_s=timeout_s)  # as many connections as in flight
    try:
        t0 = time.perf_counter()
        tasks = []
        for req, body in zip(workload.requests, bodies, strict=True):
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = Result(req.index, time.perf_counter() - t0, req.tenant)
            results.append(res)
            headers = keyed[req.api_key] if req.api_key else _HEADERS
            if req.headers:
                headers = {**headers, **dict(req.headers)}
            task = _run(pool, url, body, headers, res, timeout_s, on_done)
            tasks.append(asyncio.create_task(task))
        await asyncio.gather(*tasks)
    finally:
        await pool.close()
    return results


def _keys(workload: Workload) -> set[str]:
    return {r.api_key for r in workload.requests if r.api_key}


async def _run(
    pool: ConnectionPool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    res: Result,
    timeout_s: float,
    on_done: Callable[[Result], None] | None,
) -> None:
    await _one(pool, url, body, headers, res, timeout_s)
    if on_done is not None:
        on_done(res)
