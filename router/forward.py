"""One routed request: try the scheduler's choices in order, relay the first answer.

Retries happen only before any byte reached the client: on connect errors,
timeouts waiting for the response head, and 502/503 from the worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import aiohttp
from prometheus_client import Histogram
from starlette.types import Send

from balancer.fleet import Fleet
from balancer.worker import Outcome, Ticket, Worker
from router.admission import TTFTModel
from router.errors import RouterError
from router.kv import KVAwareness
from router.metrics import RouterMetrics
from router.relay import Relay, UpstreamTimeout, response_headers
from router.request import RoutedRequest
from router.scheduler.framework import Context

RETRYABLE_STATUS = frozenset({502, 503})
WORKER_HEADER = b"x-switchyard-worker"


class Forwarder:
    def __init__(
        self,
        fleet: Fleet,
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
        last_error: RouterError | None = None
        last_5xx: tuple[int, list[tuple[bytes, bytes]], bytes, str] | None = None
        attempts = self.max_attempts
        for attempt in range(attempts):
            worker = ranked[attempt % len(ranked)]
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            rank = self.rank_for(ctx, worker)
            url = self.fleet.rank_url(worker, rank) if rank is not None else worker.url
            attempt_headers = headers
            if rank is not None and worker.spec.dp_mode == "header":
                attempt_headers = {**headers, "X-data-parallel-rank": str(rank)}
            work_tokens = (
                self.ttft_model.work_tokens(ctx, worker) if self.ttft_model is not None else 0.0
            )
            if self.kv is not None:
                await self.kv.placed(ctx, worker, rank)
            ticket = self.fleet.begin(
                worker,
                prompt_tokens=ctx.prompt_tokens,
                dp_rank=rank,
                prefill_tokens=ctx.uncached(worker.id) if ctx.prefix is not None else None,
            )
            outcome = Outcome.CLIENT_ABORT
            try:
                try:
                    resp = await self.relay.open(url + req.route, req.body, attempt_headers)
                except UpstreamTimeout as exc:
                    outcome = Outcome.TIMEOUT
                    last_error = RouterError(
                        504, f"Upstream timeout: {exc}", code="upstream_timeout"
                    )
                    self.metrics.retries.labels("timeout").inc()
                    continue
                except (aiohttp.ClientConnectionError, OSError) as exc:
                    outcome = Outcome.CONNECT_ERROR
                    last_error = RouterError(
                        502, f"Upstream unreachable: {exc}", code="upstream_unreachable"
                    )
                    self.metrics.retries.labels("connect_error").inc()
                    continue
                try:
                    if resp.status in RETRYABLE_STATUS and attempt + 1 < attempts:
                        await resp.read()
                        outcome = Outcome.SERVER_ERROR
                        self.metrics.retries.labels(f"status_{resp.status}").inc()
                        continue
                    if resp.status in RETRYABLE_STATUS:
                        last_5xx = (
                            resp.status,
                            response_headers(resp, request_id),
                            await self.relay.read_all(resp),
                            worker.id,
                        )
                        outcome = Outcome.SERVER_ERROR
                        break
                    try:
                        tail = await self._relay_response(
                            req,
                            resp,
                            request_id,
                            send,
                            started,
                            ticket,
                            work_tokens,
                            self._after_first_byte(ctx, worker, rank),
                        )
                    except UpstreamTimeout:
                        outcome = Outcome.TIMEOUT
                        raise
                    except aiohttp.ClientError:
                        outcome = Outcome.SERVER_ERROR
                        raise
                    outcome = Outcome.SERVER_ERROR if resp.status >= 500 else Outcome.SUCCESS
                    if self.kv is not None and resp.status == 200:
                        self.kv.observe_usage(ctx, worker.id, tail)
                    return resp.status, worker.id
                finally:
                    resp.close()
            finally:
                self.fleet.end(ticket, outcome)
        self.metrics.retries.labels("exhausted").inc()
        if last_5xx is not None:
            status, resp_headers, body, worker_id = last_5xx
            resp_headers = [(k, v) for k, v in resp_headers if k != b"content-length"]
            resp_headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": resp_headers})
            await send({"type": "http.response.body", "body": body})
            return status, worker_id
        assert last_error is not None
        raise last_error

    async def _relay_response(
        self,
        req: RoutedRequest,
        resp: aiohttp.ClientResponse,
        request_id: bytes,
        send: Send,
        started: float,
        ticket: Ticket,
        work_tokens: float,
        after_first_byte: Callable[[], None],
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
            mark = self._first_chunk(ttft, started, ticket, work_tokens, after_first_byte)
            tail = await self.relay.stream(
                resp, send, mark, lambda n: self.fleet.progress(ticket, n)
            )
            await send({"type": "http.response.body", "body": b""})
            return tail
        body = await self.relay.read_all(resp)
        ttft.observe(time.perf_counter() - started)
        out_headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
        await send({"type": "http.response.body", "body": body})
        after_first_byte()
        return body

    def _after_first_byte(
        self, ctx: Context, worker: Worker, rank: int | None
    ) -> Callable[[], None]:
        """Work that must not delay the first byte (it is spawned, and runs after it)."""
        kv = self.kv

        def run() -> None:
            if kv is not None:
                kv.answered(ctx, worker, rank)

        return run

    def _first_chunk(
        self,
        ttft: Histogram,
        started: float,
        ticket: Ticket,
        work_tokens: float,
        after_first_byte: Callable[[], None],
    ) -> Callable[[], None]:
        def mark() -> None:
            elapsed = time.perf_counter() - started
            ttft.observe(elapsed)
            self.fleet.first_token(ticket)
            if self.ttft_model is not None:
                self.ttft_model.observe(ticket.worker.id, elapsed, work_tokens)
            after_first_byte()

        return mark

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1)))
        return base * self._rng.uniform(0.5, 1.5)
