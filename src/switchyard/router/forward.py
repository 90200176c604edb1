"""One routed request: try the scheduler's choices in order, relay the first answer.

Layered as httpx layers ``send``: ``forward`` is the retry loop, ``_attempt`` one
accounted call to one worker (``router.upstream.Call``), ``_relay_response`` the
relay of its answer to the client. Retries happen only before any byte reached the
client: on connect errors and 502/503 from the worker; and where the worker may have
begun on the request (it closed after the request was written, its first byte or token
was late, its answer broke off unrelayed) as ``started_requests`` allows, by default
always: the abandoned attempt's connection is closed, and vLLM and SGLang abort a request
whose client has gone, so it does not run on unseen. Where the setting forbids it, such a
request still goes elsewhere once the worker's process is gone (its port refuses a new
connection). After the first byte, a stream that may migrate resumes on another worker
(``_resume``, ``router.migration``); any other ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import Histogram
from starlette.types import Send

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Outcome, Ticket, Worker
from switchyard.net.errors import InvalidHeader, TransportError
from switchyard.net.httpclient import PieceWriter, Response
from switchyard.router.admission import Expected, TTFTModel
from switchyard.router.errors import RouterError, engine_error_body
from switchyard.router.kv import KVAwareness
from switchyard.router.metrics import RouterMetrics
from switchyard.router.migration import (
    FAILED,
    NOT_ALLOWED,
    RESUMED,
    Keeper,
    Migrator,
    Plan,
    reason_of,
)
from switchyard.router.relay import (
    EngineErrorEvent,
    Relay,
    UpstreamTimeout,
    response_headers,
    send_complete,
)
from switchyard.router.request import CHAT, COMPLETIONS, EMBEDDINGS, PASS_THROUGH, RoutedRequest
from switchyard.router.scheduler.framework import Context
from switchyard.router.upstream import Broken, Call, Unsent, may_have_started
from switchyard.router.usage import read_usage

if TYPE_CHECKING:
    from switchyard.router.tracing import Tracing

RETRYABLE_STATUS = frozenset({502, 503})
WORKER_HEADER = b"x-switchyard-worker"
# Failures before the response head that another worker may well not have.
_RETRIED = frozenset({Outcome.CONNECT_ERROR, Outcome.TIMEOUT})
# Tries of a broken worker's port, and the gap between them, before it counts as alive:
# a second in all, as a killed engine's processes can take that long to end on a busy host.
_GONE_PROBES = 20
_GONE_PROBE_GAP_S = 0.05
# The routes whose requests generate nothing: retried even where a worker may have begun.
_NON_GENERATING = frozenset({EMBEDDINGS, *PASS_THROUGH})
# max_tokens of a completion that omits it: the OpenAI API's default, which vLLM and SGLang
# apply too (a chat's default is the rest of the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def queued_prefill(ctx: Context, worker: Worker) -> int | None:
    """Prompt tokens ``worker`` must compute (its uncached part); None without a lookup."""
    return ctx.uncached(worker.id) if ctx.prefix is not None else None


def next_worker(ranked: list[Worker], attempt: int, timed_out: list[Worker]) -> Worker:
    """The worker of attempt ``attempt``: the policy's order in turn, skipping workers whose
    first byte was already late for this request. When every worker was late, the one late
    most recently: an engine that hangs is tried first and late first, and the last attempt
    (which waits the full cap) must not go back to it: with two workers, one of them hung,
    a request would go hung, loaded, hung and wait out the cap."""
    turn = attempt % len(ranked)
    if not timed_out:  # every first attempt: no list built on the request path
        return ranked[turn]
    rotated = ranked[turn:] + ranked[:turn]
    for worker in rotated:
        if all(w is not worker for w in timed_out):
            return worker
    return timed_out[-1]


def _resumer(ranked: list[Worker], tried: list[Worker]) -> Worker | None:
    """The worker a stream resumes on: the policy's first not yet tried for it, else the
    one tried longest ago, never the one that just failed (``tried[-1]``)."""
    for worker in ranked:
        if all(worker is not t for t in tried):
            return worker
    return tried[0] if len(tried) > 1 else None


class _Retry(Exception):
    """An attempt failed before any byte reached the client; ``error`` is what the client
    gets if no later attempt answers (None: keep the previous one)."""

    def __init__(self, reason: str, error: RouterError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass(frozen=True, slots=True)
class FirstByteDeadlines:
    """How long a worker may take for its first byte while another could still answer.

    The worker's predicted TTFT (its learned rate for the prompt's uncached part plus its
    queue) times ``slack``, plus ``base_s``. A non-streamed answer comes whole, so it adds
    ``output_token_allowance_s`` per output token: its ``max_tokens``, else the API's
    default for completions (16). A chat without ``max_tokens`` may generate up to the
    context, so its deadline is the learned time of whole answers instead (the prediction
    of the "whole" kind, scaled by their observed 90th-percentile spread), once the worker
    or the fleet has answered some; before that it has only the relay's cap. Never more
    than the cap; the last attempt always has the whole cap, so an answer slower than
    its deadline is retried, not lost.
    """

    base_s: float
    slack: float
    output_token_allowance_s: float

    def of(self, req: RoutedRequest, expected: Expected | None, cap_s: float) -> float | None:
        deadline = self.base_s
        if expected is not None:
            deadline += self.slack * expected.predicted_s
        if not req.stream:
            output = output_tokens(req)
            if output is not None:
                deadline += output * self.output_token_allowance_s
            elif expected is not None and expected.learned:
                deadline = self.base_s + self.slack * expected.spread * expected.predicted_s
            else:
                return None
        return min(deadline, cap_s)


def output_tokens(req: RoutedRequest) -> int | None:
    """The most tokens a non-streamed answer can have, if the request bounds it."""
    output = req.data.get("max_tokens") or req.data.get("max_completion_tokens")
    if isinstance(output, int) and not isinstance(output, bool) and output > 0:
        return output
    return COMPLETIONS_DEFAULT_MAX_TOKENS if req.route == COMPLETIONS else None


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
        deadlines: FirstByteDeadlines | None = None,
        started_requests: str = "always",
        migrator: Migrator | None = None,
    ) -> None:
        """``deadlines``: when a worker's first byte is late enough to try another (None:
        only the relay's first-byte timeout). ``started_requests`` (``never``,
        ``embeddings``, ``always``): which requests a worker may have begun go to another
        (``settings.Retry.started_requests``). ``migrator``: how a stream whose worker
        fails after its first byte resumes on another (None: it ends with an error event)."""
        self.fleet = fleet
        self.migrator = migrator
        self.started_requests = started_requests
        self.relay = relay
        self.metrics = metrics
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.kv = kv
        self.ttft_model = ttft_model
        self.deadlines = deadlines
        # Told of each streamed first token: the worker's prompt is prefilled, and a request
        # held back while it was busy may go now (``router.flow``).
        self.on_first_token: Callable[[], None] | None = None
        # Each attempt a CLIENT span when set (``router.tracing``).
        self.tracing: Tracing | None = None
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

    def retries_started(self, route: str) -> bool:
        """Whether a request to ``route`` that a worker may have begun goes to another."""
        mode = self.started_requests
        return mode == "always" or (mode == "embeddings" and route in _NON_GENERATING)

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
        timed_out: list[Worker] = []  # in the order their first byte was late
        migrator = self.migrator
        plan = (
            migrator.plan(req) if migrator is not None and req.stream and len(ranked) > 1 else None
        )
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            worker = next_worker(ranked, attempt, timed_out)
            last = attempt + 1 == attempts
            try:
                return await self._attempt(
                    req,
                    ctx,
                    worker,
                    headers,
                    request_id,
                    send,
                    started,
                    last,
                    len(ranked) > 1,
                    plan,
                )
            except Broken as broken:
                return await self._resume(req, ctx, ranked, headers, send, worker, broken)
            except _Retry as retry:
                self.metrics.retries.labels(retry.reason).inc()
                error = retry.error or error
                if retry.reason.endswith(str(Outcome.TIMEOUT)):
                    timed_out = [w for w in timed_out if w is not worker] + [worker]
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
        others: bool,
        plan: Plan | None = None,
    ) -> tuple[int, str]:
        """Send ``req`` to ``worker`` once and relay its answer; raises ``_Retry`` when it
        failed before the client saw a byte and another worker may try, ``Broken`` when a
        stream that may migrate (``plan``) failed after.

        While a later attempt can go to another worker (``others``, not ``last``, and the
        route's requests may be retried once begun), the first byte must come within
        ``deadlines``; otherwise within the relay's cap."""
        expected = (
            self.ttft_model.expect(ctx, worker, req.stream) if self.ttft_model is not None else None
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
            tracing=self.tracing,
        )
        deadlines = self.deadlines
        # A late worker is left for another only where the request may be run twice;
        # else it has the whole cap.
        again = self.retries_started(req.route)
        deadline_s = (
            deadlines.of(req, expected, self.relay.first_byte_timeout_s)
            if deadlines is not None and others and not last and again
            else None
        )
        due = None if deadline_s is None else time.monotonic() + deadline_s
        began = time.perf_counter()
        try:
            with call:
                body = req.body if plan is None else plan.body
                resp = await self.relay.open(call.url, body, call.headers, deadline_s)
                try:
                    status = resp.status
                    call.head(status)
                    if status in RETRYABLE_STATUS:
                        if last:
                            self.metrics.retries.labels("exhausted").inc()
                            await self._relay_whole(resp, request_id, send, worker)
                            return status, worker.id
                        await resp.read()
                    else:
                        tail = await self._relay_response(
                            req,
                            resp,
                            request_id,
                            send,
                            (started, began),
                            call.ticket,
                            expected,
                            ctx,
                            rank,
                            due,
                            plan,
                        )
                        usage = ctx.usage = read_usage(tail)  # once, for all that count it
                        ctx.generated = call.ticket.generated
                        if usage is not None:
                            if self.kv is not None and status == 200:
                                self.kv.observe_usage(ctx, worker.id, usage)
                            if self.tracing is not None:
                                self.tracing.usage(call.span, usage)
                        return status, worker.id
                finally:
                    resp.close()
        except Unsent as unsent:
            if not again and not await self._gone(unsent.cause, call.url):
                raise self._upstream_error(unsent.cause, worker, answered=True) from None
            raise _Retry(
                f"unsent_{call.outcome}", self._upstream_error(unsent.cause, worker, answered=True)
            ) from None
        except (UpstreamTimeout, TransportError, OSError) as exc:
            if isinstance(exc, InvalidHeader):
                raise RouterError(
                    400, f"Invalid request header: {exc}", code="invalid_header"
                ) from None
            if call.answered or call.outcome not in _RETRIED:
                if call.answered and req.stream and self.migrator is not None:
                    self._not_migrated(req, exc)
                raise self._upstream_error(exc, worker, answered=call.answered) from None
            if not again and may_have_started(exc) and not await self._gone(exc, call.url):
                raise self._upstream_error(exc, worker, answered=False) from None
            tried = {WORKER_HEADER.decode(): worker.id}
            if call.outcome is Outcome.TIMEOUT:
                error = RouterError(
                    504, f"Upstream timeout: {exc}", code="upstream_timeout", headers=tried
                )
            else:
                error = RouterError(
                    502, f"Upstream unreachable: {exc}", code="upstream_unreachable", headers=tried
                )
            raise _Retry(str(call.outcome), error) from None
        raise _Retry(f"status_{status}")

    async def _gone(self, exc: BaseException, url: str) -> bool:
        """Whether the worker's process is gone after its connection broke with ``exc``: its
        port refuses a new connection. A request it may have begun cannot go on running
        there, so another worker may take it without the engine generating twice. A
        deadline that passed proves nothing (the engine may be busy with it), nor does a
        port that cannot be reached (a network between). The port is tried a few times,
        ``_GONE_PROBE_GAP_S`` apart: a killed engine's processes do not all end at once, and
        one that inherited the listening socket accepts connections until it has."""
        if isinstance(exc, UpstreamTimeout | TimeoutError):
            return False
        parts = urlsplit(url)
        if parts.hostname is None:
            return False
        port = parts.port or (443 if parts.scheme == "https" else 80)
        for probe in range(_GONE_PROBES):
            if probe:
                await asyncio.sleep(_GONE_PROBE_GAP_S)
            try:
                async with asyncio.timeout(self.relay.connect_timeout_s):
                    _, writer = await asyncio.open_connection(parts.hostname, port)
            except ConnectionRefusedError:
                return True
            except (OSError, TimeoutError):
                return False
            writer.close()
        return False

    async def _relay_whole(
        self, resp: Response, request_id: bytes, send: Send, worker: Worker
    ) -> None:
        """The last worker's 502/503 goes to the client as it answered."""
        body = await self.relay.read_all(resp)
        headers = response_headers(resp, request_id)
        headers.append((WORKER_HEADER, worker.id.encode()))
        await send_complete(send, resp.status, headers, body)

    async def _relay_response(
        self,
        req: RoutedRequest,
        resp: Response,
        request_id: bytes,
        send: Send,
        clocks: tuple[float, float],
        ticket: Ticket,
        expected: Expected | None,
        ctx: Context,
        rank: int | None,
        due: float | None,
        plan: Plan | None = None,
    ) -> bytes:
        """Send the worker's answer to the client; return the bytes where usage would be.

        Nothing reaches the client before the first chunk of a stream (or the whole of
        another answer), so until then a failure raises ``Unsent`` and another worker may
        answer. A stream's first chunk must come by ``due`` (monotonic; None: the cap).
        ``clocks``: when the request came and when this attempt began (perf_counter).
        A stream that may migrate (``plan``) goes through a ``Keeper``; its failure after
        the first chunk raises ``Broken``.
        """
        out_headers = response_headers(resp, request_id)
        out_headers.append((WORKER_HEADER, ticket.worker.id.encode()))
        ttft = self.metrics.child(self.metrics.ttft, req.route)
        if resp.content_type.startswith(b"text/event-stream"):
            wait_s = self.relay.first_byte_timeout_s if due is None else due - time.monotonic()
            keeper = None
            try:
                first = await self.relay.first_chunk(resp, wait_s)
                if plan is not None and self.migrator is not None:
                    keeper = self.migrator.keeper(plan, req)
                    first = await self._first_events(resp, keeper, first, due)
            except (UpstreamTimeout, TransportError, OSError) as exc:
                raise Unsent(exc) from None
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            if not first:
                await send({"type": "http.response.body", "body": b""})
                return b""
            self._first_token(ttft, clocks, ticket, expected, ctx, rank)
            await send({"type": "http.response.body", "body": first, "more_body": True})
            # The app's send offers the server's piece writer (``router.app._Response``);
            # a getattr, not an isinstance of a runtime-checkable Protocol, whose attribute
            # walk (typing._get_protocol_attrs) is too slow for the request path.
            offered = getattr(send, "stream_writer", None)
            if keeper is not None and not keeper.passing:
                return await self._stream_kept(resp, send, ticket, offered, keeper)
            tail = await self.relay.stream(
                resp,
                send,
                first,
                lambda n: self.fleet.progress(ticket, n),
                offered() if offered is not None else None,
            )
            await send({"type": "http.response.body", "body": b""})
            return tail
        try:
            body = await self.relay.read_all(resp)
        except (UpstreamTimeout, TransportError, OSError) as exc:
            raise Unsent(exc) from None
        if resp.status >= 400:
            body = engine_error_body(body)
        started, began = clocks
        now = time.perf_counter()
        ttft.observe(now - started)
        if expected is not None and resp.status == 200:
            expected.observe(now - began)
        await send_complete(send, resp.status, out_headers, body)
        if self.kv is not None:
            self.kv.answered(ctx, ticket.worker, rank)
        return body

    async def _first_events(
        self, resp: Response, keeper: Keeper, first: bytes, due: float | None
    ) -> bytes:
        """The first complete events of a stream that may migrate: a first read that ends
        inside an event waits for its end, within the first chunk's time."""
        out = keeper.feed(first, first=True)
        while not out and first:
            wait_s = self.relay.first_byte_timeout_s if due is None else due - time.monotonic()
            first = await self.relay.first_chunk(resp, wait_s)
            out = keeper.feed(first, first=True) if first else keeper.flush()
        return out

    async def _stream_kept(
        self,
        resp: Response,
        send: Send,
        ticket: Ticket,
        offered: Callable[[], PieceWriter | None] | None,
        keeper: Keeper,
    ) -> bytes:
        """The rest of a stream that may migrate, after its first chunk; its mean gap between
        chunks is learned, for its worker's stall deadline."""
        migrator = self.migrator
        assert migrator is not None
        worker = ticket.worker.id
        began = time.perf_counter()
        try:
            tail = await self.relay.stream_kept(
                resp,
                send,
                lambda n: self.fleet.progress(ticket, n),
                offered() if offered is not None else None,
                keeper,
                migrator.stall_s(worker),
            )
        except (UpstreamTimeout, TransportError, OSError, EngineErrorEvent) as exc:
            raise Broken(exc, keeper) from None
        if keeper.reads > 1:
            migrator.learn(worker, (time.perf_counter() - began) / (keeper.reads - 1))
        await send({"type": "http.response.body", "body": b""})
        return tail

    async def _resume(
        self,
        req: RoutedRequest,
        ctx: Context,
        ranked: list[Worker],
        headers: dict[str, str],
        send: Send,
        worker: Worker,
        broken: Broken,
    ) -> tuple[int, str]:
        """Carry on a stream whose ``worker`` failed after its first byte on the next workers
        in the policy's order, at most ``max_per_request`` times; where it cannot, the stream
        ends as it would without migration."""
        migrator = self.migrator
        assert migrator is not None
        keeper, cause = broken.keeper, broken.cause
        tried = [worker]
        moves = 0
        options = req.data.get("stream_options")
        asked_usage = isinstance(options, dict) and options.get("include_usage") is True
        while True:
            reason = reason_of(cause)
            why = keeper.why_not()
            if why is None and moves >= migrator.max_per_request:
                why = "max_per_request"
            body = None
            if why is None:
                body = keeper.continuation(req)
                if body is None:  # nothing left to generate: the stream ends from here
                    await send(
                        {
                            "type": "http.response.body",
                            "body": keeper.ending(asked_usage),
                            "more_body": True,
                        }
                    )
                    await send({"type": "http.response.body", "body": b""})
                    self.metrics.migrations.labels(reason, RESUMED).inc()
                    ctx.usage, ctx.generated = keeper.usage(), keeper.generated()
                    return 200, worker.id
            target = _resumer(ranked, tried)
            if body is None or target is None:
                self.metrics.migrations.labels(reason, NOT_ALLOWED if why else FAILED).inc()
                return await self._end_broken(cause, worker, keeper, send)
            moves += 1
            tried = [w for w in tried if w is not target] + [target]
            try:
                resumed = await self._continue(
                    req, ctx, worker, target, headers, send, keeper, body, reason, asked_usage
                )
            except Broken as again:
                cause, worker = again.cause, target
                continue
            if resumed:
                ctx.usage, ctx.generated = keeper.usage(), keeper.generated()
                return 200, target.id
            self.metrics.migrations.labels(reason, FAILED).inc()

    async def _end_broken(
        self, cause: BaseException, worker: Worker, keeper: Keeper, send: Send
    ) -> tuple[int, str]:
        """A stream that cannot migrate ends as it would have: with the engine's own error
        event and ``[DONE]`` where it sent one, else with the router's error event."""
        error = keeper.error
        if isinstance(cause, EngineErrorEvent) and error is not None:
            if b"data: [DONE]" not in error:
                error += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": error, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return 200, worker.id
        raise self._upstream_error(cause, worker, answered=True)

    async def _continue(
        self,
        req: RoutedRequest,
        ctx: Context,
        failed: Worker,
        worker: Worker,
        headers: dict[str, str],
        send: Send,
        keeper: Keeper,
        body: bytes,
        reason: str,
        asked_usage: bool,
    ) -> bool:
        """One continuation of the stream on ``worker``: True once it ended the stream,
        False where it failed before its first chunk (nothing of it reached the client).
        Raises ``Broken`` where it failed after."""
        migrator = self.migrator
        assert migrator is not None
        began = time.perf_counter()
        tokens = keeper.carried()
        tracing = self.tracing
        span = (
            tracing.span(
                "switchyard.migrate",
                {
                    "switchyard.migration.reason": reason,
                    "switchyard.migration.from": failed.id,
                    "switchyard.worker": worker.id,
                    "switchyard.migration.tokens": tokens,
                },
            )
            if tracing is not None
            else contextlib.nullcontext()
        )
        expected = (
            self.ttft_model.expect(ctx, worker, True) if self.ttft_model is not None else None
        )
        cap = self.relay.first_byte_timeout_s
        deadline = self.deadlines.of(req, expected, cap) if self.deadlines is not None else None
        wait_s = cap if deadline is None else deadline
        rank = self.fleet.choose_rank(worker, prompt_tokens=tokens)
        with span:
            call = Call(
                self.fleet,
                worker,
                rank,
                COMPLETIONS,
                headers,
                prompt_tokens=tokens,
                tracing=tracing,
            )
            try:
                with call:
                    resp = await self.relay.open(call.url, body, call.headers, wait_s)
                    try:
                        call.head(resp.status)
                        if resp.status != 200 or not resp.content_type.startswith(
                            b"text/event-stream"
                        ):
                            await self.relay.read_all(resp)
                            return False
                        first = await self.relay.first_chunk(resp, wait_s)
                        if not first:
                            return False
                        self.fleet.first_token(call.ticket)
                        m = self.metrics
                        m.migrations.labels(reason, RESUMED).inc()
                        m.migrated_tokens.inc(tokens)
                        m.migration_resume.observe(time.perf_counter() - began)
                        resp.idle_timeout(migrator.stall_s(worker.id))
                        await self._relay_continuation(resp, send, keeper, first, asked_usage)
                        return True
                    finally:
                        resp.close()
            except (UpstreamTimeout, TransportError, OSError):
                return False

    async def _relay_continuation(
        self, resp: Response, send: Send, keeper: Keeper, chunk: bytes, asked_usage: bool
    ) -> None:
        """A continuation's events to the client as the original stream's; its failure
        raises ``Broken``."""
        try:
            while chunk:
                out, failed = keeper.translate(chunk, asked_usage)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if failed:
                    raise EngineErrorEvent("the engine sent an error event")
                chunk = await resp.readany()
        except (UpstreamTimeout, TransportError, OSError, EngineErrorEvent) as exc:
            raise Broken(exc, keeper) from None
        end = keeper.ending(asked_usage)
        if end:
            await send({"type": "http.response.body", "body": end, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _first_token(
        self,
        ttft: Histogram,
        clocks: tuple[float, float],
        ticket: Ticket,
        expected: Expected | None,
        ctx: Context,
        rank: int | None,
    ) -> None:
        """What the first streamed chunk triggers; the KV bookkeeping runs after that byte.

        The client's TTFT counts from the request; the worker's prediction is checked
        against its own attempt, not the time earlier attempts spent on a hung worker."""
        started, began = clocks
        now = time.perf_counter()
        ttft.observe(now - started)
        self.fleet.first_token(ticket)
        if self.on_first_token is not None:
            self.on_first_token()
        if expected is not None:
            expected.observe(now - began)
        if self.kv is not None:
            self.kv.answered(ctx, ticket.worker, rank)

    def _not_migrated(self, req: RoutedRequest, exc: BaseException) -> None:
        """Count a stream that failed after its first byte where migration is on but the
        request may not migrate (its kind, or a fleet of one worker)."""
        assert self.migrator is not None
        if self.migrator.settings.enabled and req.route in (COMPLETIONS, CHAT):
            self.metrics.migrations.labels(reason_of(exc), NOT_ALLOWED).inc()

    def _upstream_error(self, exc: BaseException, worker: Worker, *, answered: bool) -> RouterError:
        """What the client hears of an answer that failed: 504 if the worker went silent, else
        502 (after the first byte, the stream ends with this as its last event)."""
        tried = {WORKER_HEADER.decode(): worker.id}
        if isinstance(exc, UpstreamTimeout | TimeoutError):
            return RouterError(
                504, f"Upstream timeout: {exc}", code="upstream_timeout", headers=tried
            )
        where = "broke off its answer" if answered else "failed"
        return RouterError(
            502,
            f"Upstream worker {worker.id} {where}: {type(exc).__name__}",
            code="upstream_error",
            headers=tried,
        )

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_s * 2.0 ** (attempt - 1))
        return base * self._rng.uniform(0.5, 1.5)
