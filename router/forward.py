"""One routed request: try the scheduler's choices in order, relay the first answer.

Layered as httpx layers ``send``: ``forward`` is the retry loop, ``_attempt`` one
accounted call to one worker (``router.upstream.Call``), ``_relay_response`` the
relay of its answer to the client. Retries happen only before any byte reached the
client: on connect errors, timeouts waiting for the response head, and 502/503 from
the worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import aiohttp
from prometheus_client import Histogram
from starlette.types import Send

from balancer.view import FleetView
from balancer.worker import Outcome, Ticket, Worker
from router.admission import TTFTModel
from router.errors import RouterError
from router.kv import KVAwareness
from router.metrics import RouterMetrics
from router.relay import Relay, UpstreamTimeout, response_headers, send_complete
from router.request import RoutedRequest
from router.scheduler.framework import Context
from router.upstream import Call

RETRYABLE_STATUS = frozenset({502, 503})
WORKER_HEADER = b"x-switchyard-worker"
# Failures before the response head that another worker may well not have.
_RETRIED = frozenset({Outcome.CONNECT_ERROR, Outcome.TIMEOUT})


def queued_prefill(ctx: Context, worker: Worker) -> int | None:
    """Prompt tokens ``worker`` must compute (its uncached part); None without a lookup."""
    return ctx.uncached(worker.id) if ctx.prefix is not None else None


class _Retry(Exception):
    """An attempt failed before any byte reached the client; ``error`` is what the client
    gets if no later attempt answers (None: keep the previous one)."""

    def __init__(self, reason: str, error: RouterError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class Forwarder:
    def __init__(
        self,
        fleet: FleetView,
        relay: Relay,
        metrics: RouterMetrics,
        *,
        max_attempts: int,
        backoff_s: float,
        backoff_max_s: float,
        kv: KVAwareness | None = None,
        ttft_model: TTFTModel | None = None,
    ) -> None:
        self.fleet = fleet
        self.relay = relay
        self.metrics = metrics
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.kv = kv
        self.ttft_model = ttft_model
        self._rng = random.Random()

    def rank_for(self, ctx: Context, worker: Worker) -> int | None:
        """The DP rank holding the prefix if any, else the balancer's choice."""
        if worker.dp_size > 1 and ctx.matched.get(worker.id, 0.0) > 0:
            return ctx.matched_rank[worker.id]
        return self.fleet.choose_rank(worker, prompt_tokens=ctx.prompt_tokens)

    async def place(self, ctx: Context, worker: Worker) -> int | None:
        """Commit the request to ``worker``: its DP rank, recorded as a KV placement.

        The simulator (``loadtest.simulate``) commits its decisions through here as well.
        """
        rank = self.rank_for(ctx, worker)
        if self.kv is not None:
            await self.kv.placed(ctx, worker, rank)
        return rank

    async def forward(
        self,
        req: RoutedRequest,
        ctx: Context,
        ranked: list[Worker],
        headers: dict[str, str],
        request_id: bytes,
        send: Send,
        started: float,
    ) -> tuple[int, str]:
        """Relay the answer of the first worker that gives one; returns (status, worker id)."""
        error: RouterError | None = None
        attempts = self.max_attempts
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            worker = ranked[attempt % len(ranked)]
            last = attempt + 1 == attempts
            try:
                return await self._attempt(
                    req, ctx, worker, headers, request_id, send, started, last
                )
            except _Retry as retry:
                self.metrics.retries.labels(retry.reason).inc()
                error = retry.error or error
        self.metrics.retries.labels("exhausted").inc()
        assert error is not None
        raise error

    async def _attempt(
        self,
        req: RoutedRequest,
        ctx: Context,
        worker: Worker,
        headers: dict[str, str],
        request_id: bytes,
        send: Send,
        started: float,
        last: bool,
    ) -> tuple[int, str]:
        """Send ``req`` to ``worker`` once and relay its answer; raises ``_Retry`` when it
        failed before the client saw a byte and another worker may try."""
        work_tokens = (
            self.ttft_model.work_tokens(ctx, worker) if self.ttft_model is not None else 0.0
        )
        rank = await self.place(ctx, worker)
        call = Call(
            self.fleet,
            worker,
            rank,
            req.route,
            headers,
            prompt_tokens=ctx.prompt_tokens,
            prefill_tokens=queued_prefill(ctx, worker),
        )
        try:
            with call:
                resp = await self.relay.open(call.url, req.body, call.headers)
                try:
                    status = resp.status
                    call.head(status)
                    if status in RETRYABLE_STATUS:
                        if last:
                            self.metrics.retries.labels("exhausted").inc()
                            await self._relay_whole(resp, request_id, send)
                            return status, worker.id
                        await resp.read()
                    else:
                        tail = await self._relay_response(
                            req,
                            resp,
                            request_id,
                            send,
                            started,
                            call.ticket,
                            work_tokens,
                            ctx,
                            rank,
                        )
                        if self.kv is not None and status == 200:
                            self.kv.observe_usage(ctx, worker.id, tail)
                        return status, worker.id
                finally:
                    resp.close()
        except (UpstreamTimeout, aiohttp.ClientError, OSError) as exc:
            if call.answered or call.outcome not in _RETRIED:
                raise
            if call.outcome is Outcome.TIMEOUT:
                error = RouterError(504, f"Upstream timeout: {exc}", code="upstream_timeout")
            else:
                error = RouterError(
                    502, f"Upstream unreachable: {exc}", code="upstream_unreachable"
                )
            raise _Retry(str(call.outcome), error) from None
        raise _Retry(f"status_{status}")

    async def _relay_whole(
        self, resp: aiohttp.ClientResponse, request_id: bytes, send: Send
    ) -> None:
        """The last worker's 502/503 goes to the client as it answered."""
        body = await self.relay.read_all(resp)
        await send_complete(send, resp.status, response_headers(resp, request_id), body)

    async def _relay_response(
        self,
        req: RoutedRequest,
        resp: aiohttp.ClientResponse,
        request_id: bytes,
        send: Send,
        started: float,
        ticket: Ticket,
        work_tokens: float,
        ctx: Context,
        rank: int | None,
    ) -> bytes:
        """Send the worker's answer to the client; return the bytes where usage would be."""
        out_headers = response_headers(resp, request_id)
        out_headers.append((WORKER_HEADER, ticket.worker.id.encode()))
        ttft = self.metrics.child(self.metrics.ttft, req.route)
        content_type = resp.headers.get("Content-Type", "")
        if content_type.startswith("text/event-stream"):
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            mark = self._first_chunk(ttft, started, ticket, work_tokens, ctx, rank)
            tail = await self.relay.stream(
                resp, send, mark, lambda n: self.fleet.progress(ticket, n)
            )
            await send({"type": "http.response.body", "body": b""})
            return tail
        body = await self.relay.read_all(resp)
        ttft.observe(time.perf_counter() - started)
        await send_complete(send, resp.status, out_headers, body)
        if self.kv is not None:
            self.kv.answered(ctx, ticket.worker, rank)
        return body

    def _first_chunk(
        self,
        ttft: Histogram,
        started: float,
        ticket: Ticket,
        work_tokens: float,
        ctx: Context,
        rank: int | None,
    ) -> Callable[[], None]:
        """What the first streamed chunk triggers; the KV bookkeeping runs after that byte."""

        def mark() -> None:
            elapsed = time.perf_counter() - started
            ttft.observe(elapsed)
            self.fleet.first_token(ticket)
            if self.ttft_model is not None:
                self.ttft_model.observe(ticket.worker.id, elapsed, work_tokens)
            if self.kv is not None:
                self.kv.answered(ctx, ticket.worker, rank)

        return mark

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1)))
        return base * self._rng.uniform(0.5, 1.5)
