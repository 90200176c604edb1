"""The router's ASGI application: a lean data path, FastAPI for everything else.

The inference routes are handled by a bare ASGI function (no framework
routing, no per-request pydantic model, orjson only for the fields routing
needs), several times cheaper than a FastAPI route on this path: the three OpenAI
routes, and beside them Anthropic Messages, OpenAI Responses and the pass-through routes
(``router.apis``). Every other path (health, models, metrics, admin, docs) goes to the
FastAPI control app.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.types import Message, Receive, Scope, Send

from switchyard.balancer.adapters import Adapters
from switchyard.balancer.siblings import SiblingBus
from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Worker
from switchyard.core.auth import data_access
from switchyard.kvstore.remote import RemoteKVStore
from switchyard.kvstore.store import KVStore
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import PieceWriter
from switchyard.router.admission import PRIORITIES, Admission, TTFTModel, priority_name
from switchyard.router.apis import AnswerFilter, ResponseHolders, renaming
from switchyard.router.connections import CLIENT_GONE, STREAM_WRITER
from switchyard.router.control import build_control_app
from switchyard.router.errors import RouterError
from switchyard.router.flow.control import FlowControl, Grant
from switchyard.router.flow.identity import (
    FAIRNESS_ID_HEADER,
    Identity,
    clamp_priority,
    parse_deadline_ms,
    parse_priority,
)
from switchyard.router.flow.ratelimit import RedisRateShare, Share, SiblingRateShare
from switchyard.router.forward import WORKER_HEADER, FirstByteDeadlines, Forwarder
from switchyard.router.headers import FORWARDED_HEADERS, new_request_id, valid_request_id
from switchyard.router.kv import KVAwareness
from switchyard.router.metrics import (
    METRICS_DIR_ENV,
    FlowMetrics,
    RouterMetrics,
    flush_metric_files_on,
)
from switchyard.router.migration import Migrator
from switchyard.router.pd.orchestrator import build_orchestrator
from switchyard.router.relay import Relay, UpstreamTimeout, response_headers, send_complete
from switchyard.router.request import (
    ANTHROPIC_ROUTES,
    API_ROUTES,
    CHAT,
    COMPLETIONS,
    DATA_ROUTES,
    DETOKENIZE,
    RESPONSES,
    TOKENIZE,
    RoutedRequest,
    TokenRatio,
    parse,
)
from switchyard.router.scheduler.framework import Context, Explanation, Scheduler
from switchyard.router.scheduler.scorers import LatencyScorer
from switchyard.router.settings import RouterSettings
from switchyard.router.tenants import TenantRequests
from switchyard.router.tracing import REQUEST_ID, RequestTrace, Tracing, build_tracing
from switchyard.router.upstream import Call
from switchyard.router.usage import served_tokens

# The routes whose vLLM request schema has ``priority`` (``--flow-engine-priority``).
PRIORITY_ROUTES = frozenset((CHAT, COMPLETIONS, RESPONSES))
log = logging.getLogger("switchyard.router")
_T = TypeVar("_T")

_FAIRNESS_ID = FAIRNESS_ID_HEADER.encode("latin-1")
_RESPONSE_PATH = RESPONSES + "/"  # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel
# Tenants named by a trusted header are unbounded: cache the plain identities of this many.
_MAX_CACHED_IDENTITIES = 1024


def _max_tokens(req: RoutedRequest) -> int | None:
    """The output the client allowed (None: unsaid), for a rate-limit reservation."""
    data = req.data
    value = data.get("max_completion_tokens", data.get("max_tokens", data.get("max_output_tokens")))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _ClientGone(Exception):
    """The client went away while the router was still reading its request."""


@dataclass(slots=True)
class _Head:
    """What ``RouterApp._head`` reads of a request's headers."""

    request_id: bytes = b""
    rid: str = ""
    session: str | None = None
    priority: str | None = None
    smg_priority: str | None = None
    named_tenant: str | None = None
    slo: str | None = None
    content_length: int | None = None
    auth: bytes | None = None
    header_bytes: int = 0
    forward: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Run:
    """What a request holds while it runs, for ``RouterApp._settle`` to give back."""

    tenant: str | None = None
    admitted: bool = False  # counted in flight for its tenant
    req: RoutedRequest | None = None
    grant: Grant | None = None
    ctx: Context | None = None
    body_bytes: int = 0  # as the client sent it, before any adapter rewrote it


class _Response:
    """Wraps ``send`` to remember how far the response got (for errors and disconnects)."""

    __slots__ = ("send", "started", "finished", "client_gone", "_headers", "_writer")

    def __init__(self, send: Send, writer: Callable[[], PieceWriter | None] | None = None) -> None:
        """``writer``: the server's ``STREAM_WRITER`` extension, where it has one."""
        self.send = send
        self._writer = writer
        self.started = False
        self.finished = False
        self.client_gone = False
        self._headers: Any = ()  # the response's, once started

    @property
    def is_sse(self) -> bool:
        """The response started as an event stream. Read only when an error must end it, so
        its headers are looked through then, not on every response."""
        return any(
            k == b"content-type" and v.startswith(b"text/event-stream") for k, v in self._headers
        )

    def stream_writer(self) -> PieceWriter | None:
        """The server's synchronous writer of the next streamed pieces, if it has one."""
        return self._writer() if self._writer is not None else None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = message.get("headers", ())
            if not isinstance(headers, list | tuple):  # an iterator, read once by the server
                headers = message["headers"] = list(headers)
            self._headers = headers
        elif not message.get("more_body", False):
            self.finished = True
        await self.send(message)


class RouterApp:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: FleetView,
        scheduler: Scheduler,
        kvstore: KVStore | RemoteKVStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        siblings: SiblingBus | None = None,
        model_schedulers: Mapping[str, Scheduler] | None = None,
    ) -> None:
        """``clock`` dates the router's snapshots (a simulator passes its virtual clock).
        ``siblings``: the bus to the other processes of this router (``--processes``).
        ``model_schedulers``: the models routed by a policy other than ``scheduler``'s."""
        self.settings = settings
        self.fleet = fleet
        self.adapters = Adapters(fleet)
        self.siblings = siblings
        self.scheduler = scheduler
        self.model_schedulers = dict(model_schedulers or {})
        self.metrics = RouterMetrics()
        self.kv = (
            KVAwareness(
                kvstore,
                fleet,
                self.metrics,
                speculative_ttl_s=settings.kv.speculative_ttl_s,
                event_lag_ttl_s=settings.kv.event_lag_ttl_s,
                parity_interval_s=settings.kv.parity_interval_s if settings.kv.parity else None,
                clock=clock,
                siblings=siblings,
            )
            if kvstore is not None
            else None
        )
        self.ttft_model = TTFTModel(
            settings.admission.prior_tokens_per_s, self.metrics.ttft_prediction
        )
        for sched in (scheduler, *self.model_schedulers.values()):
            for scorer, _ in sched.scorers:
                if isinstance(scorer, LatencyScorer):
                    scorer.speeds = self.ttft_model
        self.admission = Admission(
            self.ttft_model,
            self.metrics,
            default_slo_ms=settings.admission.slo_ttft_ms,
            max_wait_ms=settings.admission.max_wait_ms,
            margin_ratio=settings.admission.margin_ratio,
            calibrate=settings.admission.calibrate,
        )
        self.relay = Relay(
            connect_timeout_s=settings.timeouts.connect_s,
            first_byte_timeout_s=settings.timeouts.first_byte_s,
            idle_timeout_s=settings.timeouts.idle_s,
            max_connections_per_worker=settings.limits.max_connections_per_worker,
            max_head_bytes=settings.limits.max_response_head_bytes,
            ssl_context=settings.tls.context(),
        )
        self.forwarder = Forwarder(
            fleet,
            self.relay,
            self.metrics,
            max_attempts=settings.retry.max_attempts,
            backoff_s=settings.retry.backoff_s,
            backoff_max_s=settings.retry.backoff_max_s,
            kv=self.kv,
            ttft_model=self.ttft_model,
            deadlines=FirstByteDeadlines(
                settings.timeouts.first_byte_base_s,
                settings.timeouts.first_byte_slack,
                settings.timeouts.output_token_allowance_s,
            ),
            started_requests=settings.retry.started_requests,
            migrator=Migrator(settings.migration, settings.timeouts.idle_s),
        )
        self.pd = build_orchestrator(
            settings.pd,
            fleet,
            self.relay,
            self.forwarder,
            self.metrics,
            max_attempts=settings.retry.max_attempts,
            kv=self.kv,
        )
        self.api_key = data_access(settings.api_key)
        self.tenants = TenantRequests(
            self.metrics.registry, settings.limits.max_in_flight_per_tenant, settings.retry.after_s
        )
        self.worker_authorization = (
            f"Bearer {settings.worker_api_key}" if settings.worker_api_key else None
        )
        self._routes = {route: route for route in DATA_ROUTES}
        self._api_routes = {route: route for route in API_ROUTES}
        # Public model name -> (served name, the answer's bytes to swap); empty: no aliases.
        self._aliases = {
            public: (served, renaming(served, public))
            for public, served in settings.aliases.items()
        }
        self.responses = ResponseHolders(siblings=siblings)
        self.flow = self._build_flow(settings, fleet, siblings)
        if self.flow is not None:
            self.forwarder.on_first_token = self.flow.prefilled
        flow = settings.flow
        self._tenant_header = flow.tenant_header.encode("latin-1") if flow.tenant_header else None
        self._max_priority = flow.max_priority
        self.token_ratio = TokenRatio()  # flow control's prompt estimates, in engine tokens
        self._engine_priority = flow.engine_priority and self.flow is not None
        # The identities of requests that name no priority and no deadline, one per tenant.
        self._identities: dict[str, Identity] = {}
        self._draining = False
        # The loop the app was started on, which serves its requests: asked for a request's
        # task, asyncio finds it without asking the OS for the pid (Python 3.11 does, to
        # notice a fork, whenever it is given no loop).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.tracing: Tracing | None = None
        self.set_tracing(build_tracing(settings.tracing))
        self._log_request_ids = settings.log_format == "json"
        self.control = build_control_app(self)

    def set_tracing(self, tracing: Tracing | None) -> None:
        """Trace requests with ``tracing`` (None: not at all), on every path."""
        self.tracing = tracing
        self.forwarder.tracing = tracing
        if self.pd is not None:
            self.pd.set_tracing(tracing)

    def _build_flow(
        self, settings: RouterSettings, fleet: FleetView, siblings: SiblingBus | None
    ) -> FlowControl | None:
        if not settings.flow.enabled:
            return None
        share: Share | None = None
        limits = settings.flow.tenant_tokens_per_minute or settings.flow.tenant_requests_per_minute
        if limits and settings.redis_url:
            share = RedisRateShare(settings.redis_url)
        elif limits and siblings is not None:
            share = SiblingRateShare(siblings)
        return FlowControl(
            fleet,
            settings.flow,
            FlowMetrics(self.metrics),
            retry_after_s=settings.retry.after_s,
            share=share,
            siblings=siblings,
        )

    @property
    def draining(self) -> bool:
        """Shutting down: /ready answers 503 while requests finish; nothing more is queued."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value and self.flow is not None:
            self.flow.shutdown()  # a queued request would wait past the shutdown: 503 now

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if METRICS_DIR_ENV in os.environ:  # one of several processes: metric files to write
            flush_metric_files_on(asyncio.get_running_loop())
        if self.siblings is not None:
            await self.siblings.start()
        await self.relay.start()
        if self.pd is not None:
            await self.pd.start()
        if self.kv is not None:
            await self.kv.start()
        await self.fleet.start()
        if self.flow is not None:
            await self.flow.start()
        self.admission.start(self.fleet, self.relay.pool)

    async def stop(self) -> None:
        await self.admission.stop()
        if self.flow is not None:
            self.flow.shutdown()
            await self.flow.stop()
        await self.fleet.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.pd is not None:
            await self.pd.stop()
        await self.relay.stop()
        if self.siblings is not None:
            await self.siblings.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        if METRICS_DIR_ENV in os.environ:
            flush_metric_files_on(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self._routes.get(scope["path"])
            if route is not None:
                if scope["method"] == "POST":
                    await self._handle(route, scope, receive, send)
                else:
                    error = RouterError(405, f"Method {scope['method']} not allowed; use POST")
                    await self._send_error(_Response(send), error, new_request_id())
                return
            route = self._api_routes.get(scope["path"])
            if route is not None:
                if scope["method"] == "POST":
                    await self._handle(route, scope, receive, send, api=True)
                else:
                    error = RouterError(405, f"Method {scope['method']} not allowed; use POST")
                    await self._send_error(_Response(send), error, new_request_id(), route)
                return
            if scope["path"].startswith(_RESPONSE_PATH):
                await self._stored_response(scope, receive, send)
                return
            limit = self.settings.limits.max_header_bytes
            if sum(len(k) + len(v) for k, v in scope["headers"]) > limit:
                error = RouterError(
                    431, f"Request headers exceed {limit} bytes", code="headers_too_large"
                )
                await self._send_error(_Response(send), error, new_request_id())
                return
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.control(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(
        self, route: str, scope: Scope, receive: Receive, send: Send, api: bool = False
    ) -> None:
        """One request on a data route; ``api``: one of ``API_ROUTES``. Its stages: the
        head (``_head``), the caller and the body (``_arrive``), admission and flow control
        (``_grant``), the choice of worker and the relay (``_dispatch``), and the
        accounting once it ended (``_settle``)."""
        started = time.perf_counter()
        head = self._head(scope)
        request_id = head.request_id
        trace: RequestTrace | None = None
        if self.tracing is not None:
            trace = self.tracing.request(route, head.forward, head.rid, started)
        if self._log_request_ids:
            REQUEST_ID.set(head.rid)  # this request's task has a context of its own
        extensions = scope.get("extensions") or {}
        response = _Response(send, extensions.get(STREAM_WRITER))
        status, worker_id = 500, "none"
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:  # not started, or started on another loop than this request's
            task = asyncio.current_task()
        assert task is not None
        run = _Run()
        try:
            identity, req = await self._arrive(route, head, scope, receive, api, run)
            if trace is not None:
                trace.describe(req.model, identity.tenant, priority_name(identity.priority))
            sink: Send = response
            holder: str | None = None
            if api or self._aliases:
                sink, holder = self._adapt(route, req, response)
            when_gone = extensions.get(CLIENT_GONE)
            if when_gone is not None:
                when_gone(functools.partial(self._on_client_gone, task, response))
            disaggregated = self.pd is not None and self.pd.applies(req)
            candidates = await self._grant(
                identity, req, disaggregated, receive, task, response, trace, when_gone, run
            )
            dispatch = await self._dispatch(
                route, req, identity, head, disaggregated, candidates, holder, sink, started, run
            )
            if when_gone is not None:
                status, worker_id = await dispatch
            else:
                status, worker_id = await self._watching_receive(dispatch, receive, task, response)
        except RouterError as exc:
            status = exc.status
            await self._send_error(response, exc, request_id, route)
        except _ClientGone:
            status = 499
        except asyncio.CancelledError:
            if not (response.client_gone or self.draining):
                raise
            task.uncancel()
            if response.client_gone:
                status = 499
                self.metrics.client_disconnects.inc()
            else:  # the shutdown timeout passed: a clean error rather than a cut connection
                status = 503
                stop = RouterError(503, "The router is shutting down", code="shutting_down")
                await self._send_error(response, stop, request_id, route)
        except Exception:
            log.exception("unexpected error routing %s", request_id.decode("latin-1"))
            status = 500
            await self._send_error(
                response,
                RouterError(500, "Internal router error", code="internal_error"),
                request_id,
                route,
            )
        finally:
            self._settle(run)
            if trace is not None:
                trace.end(status, worker_id)
        m = self.metrics
        m.child(m.requests, route, str(status), worker_id).inc()
        self.tenants.count(run.tenant, status)
        m.child(m.latency, route).observe(time.perf_counter() - started)

    def _head(self, scope: Scope) -> _Head:
        """What the router reads of a request's headers, in one pass over them, and the
        headers it forwards; the request id is the client's when valid, else a new one."""
        head = _Head()
        tenant_header = self._tenant_header
        forward = head.forward
        header_bytes = 0
        for key, value in scope["headers"]:
            header_bytes += len(key) + len(value)
            if key == b"x-request-id":
                head.request_id = value
                continue
            if key == b"x-session-id":
                head.session = value.decode("latin-1")
            elif key == b"x-priority":
                head.priority = value.decode("latin-1")
            elif key == b"x-smg-priority":
                head.smg_priority = value.decode("latin-1")
            elif tenant_header is not None and (key == tenant_header or key == _FAIRNESS_ID):
                if head.named_tenant is None or key == tenant_header:
                    head.named_tenant = value.decode("latin-1").strip() or head.named_tenant
            elif key == b"x-slo-ttft-ms":
                head.slo = value.decode("latin-1")
            elif key == b"content-length":
                head.content_length = int(value) if value.isdigit() else None
            elif key == b"authorization":
                head.auth = value
            name = FORWARDED_HEADERS.get(key)
            if name is not None:
                forward[name] = value.decode("latin-1")
        head.header_bytes = header_bytes
        if not head.request_id or not valid_request_id(head.request_id):
            head.request_id = new_request_id()
        head.rid = forward["x-request-id"] = head.request_id.decode("ascii")
        if self.worker_authorization is not None:
            forward["authorization"] = self.worker_authorization
        return head

    async def _arrive(
        self, route: str, head: _Head, scope: Scope, receive: Receive, api: bool, run: _Run
    ) -> tuple[Identity, RoutedRequest]:
        """Who is asking (401 without a valid key; the tenant is counted in from here) and
        what: the body read and parsed."""
        if head.header_bytes > self.settings.limits.max_header_bytes:
            raise RouterError(
                431,
                f"Request headers exceed {self.settings.limits.max_header_bytes} bytes",
                code="headers_too_large",
            )
        tenant = self.api_key.tenant(head.auth)
        if tenant is None and api and head.auth is None and route in ANTHROPIC_ROUTES:
            tenant = self.api_key.tenant_of_key(_header(scope, b"x-api-key"))
        if tenant is None:
            raise RouterError(401, "Invalid or missing API key", code="invalid_api_key")
        run.tenant = tenant
        self.tenants.admit(tenant)
        run.admitted = True
        identity = self._identity(
            tenant, head.named_tenant, head.priority, head.smg_priority, head.slo
        )
        body = await self._read_body(receive, head.content_length)
        run.body_bytes = len(body)
        req = run.req = parse(route, body, head.session, self.settings.client_kv_transfer)
        req.chars_per_token = self.token_ratio.value
        return identity, req

    async def _grant(
        self,
        identity: Identity,
        req: RoutedRequest,
        disaggregated: bool,
        receive: Receive,
        task: asyncio.Task[Any],
        response: _Response,
        trace: RequestTrace | None,
        when_gone: Any,
        run: _Run,
    ) -> list[Worker] | None:
        """Flow control's turn for the request, at once or after a wait in its queue (the
        grant is kept in ``run``); the fleet's candidates when the turn came at once, for
        routing to reuse (after a wait, routing reads them again)."""
        flow = self.flow
        if flow is None:
            return None
        candidates = None if disaggregated else self.fleet.candidates(req.model)
        run.grant = flow.grant_now(
            identity.tenant, req.model, req.prompt_tokens_estimate, candidates
        )
        if run.grant is not None:
            return candidates
        admit = flow.admit(
            identity,
            req.model,
            run.body_bytes,
            req.prompt_tokens_estimate,
            _max_tokens(req) if flow.limiter is not None else None,
        )
        waiting = (
            admit
            if when_gone is not None
            else self._watching_receive(admit, receive, task, response)
        )
        run.grant = await (waiting if trace is None else trace.queued(waiting))
        return None

    async def _dispatch(
        self,
        route: str,
        req: RoutedRequest,
        identity: Identity,
        head: _Head,
        disaggregated: bool,
        candidates: list[Worker] | None,
        holder: str | None,
        sink: Send,
        started: float,
        run: _Run,
    ) -> Awaitable[tuple[int, str]]:
        """The worker (or the P/D legs) chosen, the request's context kept in ``run``, and
        the relay of its answer, to be awaited; a grant from the queue counts as begun."""
        grant, flow = run.grant, self.flow
        if disaggregated:
            assert self.pd is not None
            ctx = run.ctx = self.pd.context(req, head.request_id)
            if grant is not None and grant.starting:
                assert flow is not None
                # the handler reaches its first leg's worker before it first waits (on the
                # network, or the KV store), and the pump this sets off runs then
                flow.begun(grant)
            return self.pd.handle(req, head.forward, head.request_id, sink, started, ctx)
        ctx, ranked = await self.schedule(
            req, head.request_id, priority_name(identity.priority), head.slo, candidates
        )
        run.ctx = ctx
        if holder is not None:
            ranked = _holder_first(ranked, holder)
        if grant is not None and grant.starting:  # dispatched from the queue
            assert flow is not None
            flow.begun(grant)
        if self._engine_priority and route in PRIORITY_ROUTES:
            assert flow is not None
            req.data["priority"] = flow.engine_priority(identity)
            req.body = orjson.dumps(req.data)
        return self.forwarder.forward(
            req, ctx, ranked, head.forward, head.request_id, sink, started
        )

    def _settle(self, run: _Run) -> None:
        """What an ended request gives back: its tenant's slot, and its grant charged with
        the tokens it was served (the engine's usage, else what the router counted)."""
        if run.admitted:
            assert run.tenant is not None
            self.tenants.release(run.tenant)
        ctx, req, grant = run.ctx, run.req, run.grant
        if ctx is not None:
            usage = ctx.usage
            if (
                usage is not None
                and req is not None
                and (ctx.prefix is None or not ctx.prefix.exact)  # untokenized here
            ):
                self.token_ratio.observe(req.prompt_chars, usage.prompt)
            if grant is not None:
                assert self.flow is not None
                prompt, output = served_tokens(usage, ctx.prompt_tokens, ctx.generated)
                self.flow.release(grant, prompt, output)
        elif grant is not None:
            assert self.flow is not None
            self.flow.release(grant, 0, 0)

    def _adapt(
        self, route: str, req: RoutedRequest, response: _Response
    ) -> tuple[Send, str | None]:
        """What a request on an API route or naming an alias needs before it is routed: the
        fleet's one model where a (de)tokenize names none, the served model for an alias,
        the worker holding a ``previous_response_id``; and the filter its answer goes
        through (or the response itself)."""
        if not req.model and route in (TOKENIZE, DETOKENIZE):
            models = self.fleet.models()
            if len(models) != 1:
                raise RouterError(
                    400,
                    "Missing required parameter: 'model' (the fleet serves several)",
                    param="model",
                )
            req.model = models[0]
        rename: tuple[bytes, bytes] | None = None
        alias = self._aliases.get(req.model) if self._aliases else None
        if alias is not None:
            served, rename = alias
            req.data["model"] = req.model = served
            req.body = orjson.dumps(req.data)
        holder: str | None = None
        on_id = None
        if route == RESPONSES:
            on_id = self.responses.remember
            previous = req.data.get("previous_response_id")
            if isinstance(previous, str):
                holder = self.responses.holder(previous)
        if rename is None and route not in API_ROUTES:
            return response, holder
        return AnswerFilter(response, route, rename, on_id), holder

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel (vLLM's, with the
        engine's response store on), relayed to the worker that answered that id."""
        response = _Response(send)
        request_id = _header(scope, b"x-request-id") or b""
        if not valid_request_id(request_id):
            request_id = new_request_id()
        status, worker_id = 500, "none"
        try:
            if self.api_key.tenant(_header(scope, b"authorization")) is None:
                raise RouterError(401, "Invalid or missing API key", code="invalid_api_key")
            response_id, _, action = scope["path"][len(_RESPONSE_PATH) :].partition("/")
            method = scope["method"]
            if not response_id or action not in ("", "cancel"):
                raise RouterError(404, f"No route {scope['path']}", code="not_found")
            if (method, action) not in (("GET", ""), ("DELETE", ""), ("POST", "cancel")):
                raise RouterError(405, f"Method {method} not allowed on {scope['path']}")
            holder = self.responses.holder(response_id)
            worker = self.fleet.get(holder) if holder is not None else None
            if worker is None:
                raise RouterError(
                    404,
                    f"Response with id '{response_id}' not found.",
                    param="response_id",
                    code="response_not_found",
                )
            body = await self._read_body(receive, None)
            status, worker_id = await self._relay_stored(scope, worker, body, request_id, response)
        except RouterError as exc:
            status = exc.status
            await self._send_error(response, exc, request_id)
        except _ClientGone:
            status = 499
        self.metrics.child(
            self.metrics.requests, _RESPONSE_PATH + "{id}", str(status), worker_id
        ).inc()

    async def _relay_stored(
        self, scope: Scope, worker: Worker, body: bytes, request_id: bytes, response: _Response
    ) -> tuple[int, str]:
        path = scope["path"]
        query = scope.get("query_string", b"")
        if query:
            path += "?" + query.decode("latin-1")
        headers = {"x-request-id": request_id.decode("latin-1")}
        if self.worker_authorization is not None:
            headers["authorization"] = self.worker_authorization
        call = Call(self.fleet, worker, None, path, headers, prompt_tokens=0, tracing=None)
        try:
            with call:
                resp = await self.relay.pool.request(
                    scope["method"], call.url, body, call.headers, self.relay.first_byte_timeout_s
                )
                try:
                    call.head(resp.status)
                    out = response_headers(resp, request_id)
                    out.append((WORKER_HEADER, worker.id.encode()))
                    if not resp.content_type.startswith(b"text/event-stream"):
                        await send_complete(
                            response, resp.status, out, await self.relay.read_all(resp)
                        )
                        return resp.status, worker.id
                    await response(
                        {"type": "http.response.start", "status": resp.status, "headers": out}
                    )
                    await self.relay.stream(resp, response, b"", lambda n: None)
                    await response({"type": "http.response.body", "body": b""})
                    return resp.status, worker.id
                finally:
                    resp.close()
        except (UpstreamTimeout, TransportError, OSError) as exc:
            if response.started:
                return 502, worker.id
            raise RouterError(
                502,
                f"Upstream worker {worker.id} failed: {type(exc).__name__}",
                code="upstream_error",
                headers={WORKER_HEADER.decode(): worker.id},
            ) from None

    def _identity(
        self,
        tenant: str,
        named_tenant: str | None,
        priority_header: str | None,
        smg_priority: str | None,
        slo_header: str | None,
    ) -> Identity:
        """Who the request is for flow control; a bad priority or deadline is a 400."""
        if named_tenant is not None:
            tenant = named_tenant
        if priority_header is None and smg_priority is None and slo_header is None:
            identity = self._identities.get(tenant)
            if identity is None:
                identity = Identity(tenant, 0, self.settings.admission.slo_ttft_ms)
                if len(self._identities) < _MAX_CACHED_IDENTITIES:
                    self._identities[tenant] = identity
            return identity
        try:
            priority = parse_priority(priority_header, smg=smg_priority)
            deadline_ms = parse_deadline_ms(slo_header)
        except ValueError as exc:
            raise RouterError(400, str(exc), code="invalid_header") from None
        if self._max_priority or priority > 0:
            priority = clamp_priority(priority, tenant, self._max_priority)
        if deadline_ms is None:
            deadline_ms = self.settings.admission.slo_ttft_ms
        return Identity(tenant, priority, deadline_ms)

    async def schedule(
        self,
        req: RoutedRequest,
        request_id: bytes,
        priority: str,
        slo_header: str | None,
        candidates: list[Worker] | None = None,
    ) -> tuple[Context, list[Worker]]:
        """Candidates (``candidates``: the fleet's now, where the caller has them), prefix
        matches, the policy's order, then SLO admission.

        No I/O of its own: ``switchyard simulate`` runs this same decision on a virtual clock.
        """
        tracing = self.tracing
        if tracing is None or not tracing.recording():
            return await self._schedule(req, request_id, priority, slo_header, None, candidates)
        with tracing.span("schedule") as span:
            explain = Explanation()
            ctx, ranked = await self._schedule(
                req, request_id, priority, slo_header, explain, candidates
            )
            tracing.describe_schedule(span, self.scheduler_for(req.model).policy, ctx, ranked)
            return ctx, ranked

    async def _schedule(
        self,
        req: RoutedRequest,
        request_id: bytes,
        priority: str,
        slo_header: str | None,
        explain: Explanation | None,
        candidates: list[Worker] | None = None,
    ) -> tuple[Context, list[Worker]]:
        began = time.perf_counter()
        if candidates is None:
            candidates = self.fleet.candidates(req.model)
        if not candidates:
            # A model no worker lists: read the models again, or place a registered adapter.
            candidates = await self.adapters.resolve(req.model)
            if not candidates:
                raise self._no_candidates(req.model)
        if priority not in PRIORITIES:
            raise RouterError(400, f"x-priority must be one of {', '.join(PRIORITIES)}")
        ctx = Context(
            model=req.model,
            session_key=req.session_key,
            prompt_tokens=req.prompt_tokens_estimate,
            request_id=request_id.decode("latin-1"),
            priority=priority,
            explain=explain,
            lora_name=req.model if self.fleet.parent_of(req.model) else None,
        )
        scheduler = self.scheduler_for(req.model)
        if (
            self.kv is not None
            and scheduler.needs_prefix
            and ctx.prompt_tokens <= self.settings.kv.max_prompt_tokens
        ):
            await self.kv.annotate(ctx, req, candidates)
            if ctx.prefix is not None and ctx.prefix.exact:
                self.token_ratio.observe(req.prompt_chars, ctx.prompt_tokens)
        ranked = scheduler.schedule(ctx, candidates)
        if not ranked:
            raise self._unavailable("No worker can take this request now")
        self._count_decision(ctx, ranked[0], scheduler.policy)
        objective = self.admission.objective_s(ctx, slo_header)
        if objective is not None:
            await self.admission.admit(ctx, ranked, objective, req.stream)
        self.metrics.child(self.metrics.schedule, req.turn).observe(time.perf_counter() - began)
        return ctx, ranked

    def scheduler_for(self, model: str) -> Scheduler:
        """The scheduler of ``model``: its own policy's, else the router's."""
        if self.model_schedulers:
            return self.model_schedulers.get(model, self.scheduler)
        return self.scheduler

    def _count_decision(self, ctx: Context, first: Worker, policy: str) -> None:
        m = self.metrics
        m.child(m.decisions, policy, first.id).inc()
        reason = ctx.reason or ("prefix" if ctx.matched.get(first.id, 0.0) > 0 else "load")
        m.child(m.decision_reasons, policy, reason).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s -> %s (%s, matched %.0f of %d tokens; cached blocks %s)",
                ctx.request_id,
                first.id,
                reason,
                ctx.matched.get(first.id, 0.0),
                ctx.prompt_tokens,
                ctx.cached_blocks,
            )

    async def _read_body(self, receive: Receive, content_length: int | None) -> bytes:
        limit = self.settings.limits.max_body_bytes
        if content_length is not None and content_length > limit:
            raise RouterError(413, f"Request body exceeds {limit} bytes", code="body_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RouterError(413, f"Request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _watching_receive(
        self,
        dispatch: Awaitable[_T],
        receive: Receive,
        task: asyncio.Task[Any],
        response: _Response,
    ) -> _T:
        """``dispatch`` (or a wait in the queue) under a server without ``CLIENT_GONE``: a task
        waits for the standard ``http.disconnect``, so the request is still cancelled when its
        client goes away."""
        watcher = asyncio.create_task(self._await_disconnect(receive, task, response))
        try:
            return await dispatch
        finally:
            watcher.cancel()

    async def _await_disconnect(
        self, receive: Receive, task: asyncio.Task[Any], response: _Response
    ) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the body was read already: any further message is a stray empty chunk
        self._on_client_gone(task, response)

    @staticmethod
    def _on_client_gone(task: asyncio.Task[Any], response: _Response) -> None:
        """Cancel the request the moment the client disconnects, so the worker sees the abort."""
        if not response.finished:
            response.client_gone = True
            task.cancel()

    def _no_candidates(self, model: str) -> RouterError:
        if self.fleet.has_model(model) or not self.fleet.models():
            return self._unavailable(f"No healthy worker serves model '{model}'")
        return RouterError(
            404, f"The model '{model}' does not exist", param="model", code="model_not_found"
        )

    def _unavailable(self, message: str) -> RouterError:
        return RouterError(
            503,
            message,
            code="no_healthy_worker",
            headers={"retry-after": str(self.settings.retry.after_s)},
        )

    async def _send_error(
        self, response: _Response, exc: RouterError, request_id: bytes, route: str = ""
    ) -> None:
        """``exc`` in the shape of ``route``'s API: Anthropic's on the Messages route."""
        if response.client_gone:
            return
        anthropic = route in ANTHROPIC_ROUTES
        body = exc.anthropic_body() if anthropic else exc.body()
        if response.started:
            if not response.finished:
                event = b"event: error\n" if anthropic else b""
                tail = event + b"data: " + body + b"\n\n" if response.is_sse else b""
                await response({"type": "http.response.body", "body": tail})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id),
            *((k.encode(), v.encode()) for k, v in exc.headers.items()),
        ]
        if WORKER_HEADER.decode() not in exc.headers:
            headers.append((WORKER_HEADER, b"none"))
        await send_complete(response, exc.status, headers, body)


def _header(scope: Scope, name: bytes) -> bytes | None:
    key: bytes
    value: bytes
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _holder_first(ranked: list[Worker], holder: str) -> list[Worker]:
    """The policy's order with the worker that holds the previous response first, where it
    may take the request; else the order as it was (that worker will not find the id)."""
    for i, worker in enumerate(ranked):
        if worker.id == holder:
            return [worker, *ranked[:i], *ranked[i + 1 :]] if i else ranked
    return ranked
