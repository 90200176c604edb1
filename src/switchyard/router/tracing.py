"""OpenTelemetry traces of the requests the router routes, and its JSON log lines.

Tracing is off unless an OTLP endpoint is configured (``tracing.otlp_traces_endpoint``, else
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``). The endpoint
setting takes vLLM's ``--otlp-traces-endpoint`` and is read as vLLM reads it: gRPC, unless
``tracing.protocol`` or ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` says otherwise or the URL
ends in ``/v1/traces`` (http/protobuf's path), so one flag value serves both. An endpoint
from the ``OTEL_*`` variables alone keeps OpenTelemetry's default, http/protobuf. What would
fail every export (the gRPC exporter not installed, an endpoint that is no URL) stops the
start in one line (``check``) instead of a warning at every batch. Off, the router
loads neither the tracing SDK nor an exporter, and the request path holds ``None`` where a
``Tracing`` would be, so it makes no span object. On, one request's spans are::

    POST /v1/chat/completions    SERVER, child of the client's traceparent if it sent one
    ├── queue                    the wait in flow control's queue (only if it waited)
    ├── schedule                 candidates, each scorer's scores, the chosen worker
    └── POST /v1/chat/completions  CLIENT, one per attempt; the engine gets its traceparent

and on the P/D path ``encode``, ``prefill`` and ``decode`` (each around its CLIENT spans) and
``kv_transfer`` (from the prefill's answer to the decode's first byte, for a stream). The
standard ``OTEL_*`` variables configure what the settings leave unset (service name,
resource attributes, exporter headers and timeouts, sampler).

The tracer provider is the router's own, not the global one: an engine or a test in the
same process keeps its own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Awaitable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from switchyard.router.errors import RouterError

if TYPE_CHECKING:
    from opentelemetry.context import Context as OtelContext
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from switchyard.balancer.worker import Worker
    from switchyard.router.flow.control import Grant
    from switchyard.router.scheduler.framework import Context, Explanation
    from switchyard.router.settings import Tracing as TracingSettings
    from switchyard.router.usage import Usage

SERVICE_NAME = "switchyard-router"
# How long a stopping router waits for its last spans to be exported.
SHUTDOWN_FLUSH_S = 0.5
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
HTTP = "http/protobuf"
GRPC = "grpc"
# http/protobuf's path for traces; a URL that ends in it names that protocol.
TRACES_PATH = "/v1/traces"
_GRPC_EXPORTER = "opentelemetry.exporter.otlp.proto.grpc"
# The OpenAI routes' GenAI operation names (gen_ai.operation.name).
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/responses": "chat",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# Longest worker list a schedule span names (a large fleet would make every span large).
_MAX_LISTED = 16

# The request being routed, for log lines; set only while JSON logs are on.
REQUEST_ID: ContextVar[str | None] = ContextVar("switchyard_request_id", default=None)
# The server span of the request being routed, for what the legs learn (usage).
_SERVER_SPAN: ContextVar[Span | None] = ContextVar("switchyard_server_span", default=None)


def _from_env(names: tuple[str, ...], environ: Mapping[str, str]) -> str | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def enabled(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the router traces: an endpoint is set and the SDK is not disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(settings.otlp_traces_endpoint or _from_env(_ENDPOINT_ENV, environ))


def build_tracing(
    settings: TracingSettings,
    environ: Mapping[str, str] = os.environ,
    exporter: SpanExporter | None = None,
) -> Tracing | None:
    """The router's tracing, or None when it is off (no OpenTelemetry import then).

    ``exporter`` replaces the OTLP exporter and exports each span as it ends (tests)."""
    if exporter is None and not enabled(settings, environ):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": SERVICE_NAME})
    ratio = settings.sample_ratio
    # None: the SDK reads OTEL_TRACES_SAMPLER(_ARG), whose default is parent-based always-on.
    sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return Tracing(provider)
    otlp = _otlp_exporter(settings, environ)
    provider.add_span_processor(BatchSpanProcessor(otlp))
    return Tracing(provider, otlp)


def protocol(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP protocol the traces go over: the setting, else the OTEL variables, else
    what the endpoint setting says as vLLM reads it (gRPC unless it ends in /v1/traces),
    else OpenTelemetry's own default for an endpoint from its variables."""
    chosen = settings.protocol or _from_env(_PROTOCOL_ENV, environ)
    if chosen is not None:
        return chosen
    endpoint = settings.otlp_traces_endpoint
    if not endpoint:
        return HTTP
    return HTTP if urlsplit(endpoint.strip()).path.rstrip("/").endswith(TRACES_PATH) else GRPC


def check(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> None:
    """Raise ``ValueError`` (one line) for a tracing set-up whose every export would fail:
    an unknown protocol, the gRPC exporter not installed, an endpoint that is no URL of
    the protocol. Nothing is checked, and nothing imported, while tracing is off."""
    if not enabled(settings, environ):
        return
    chosen = protocol(settings, environ)
    if chosen not in (HTTP, GRPC):
        raise ValueError(f"OTLP protocol {chosen!r}: use {HTTP} or {GRPC}")
    if chosen == GRPC and importlib.util.find_spec(_GRPC_EXPORTER) is None:
        raise ValueError(
            "OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc: pip install "
            f"'switchyard[otlp-grpc]' (or --tracing-protocol {HTTP} with a /v1/traces URL)"
        )
    name = "tracing.otlp_traces_endpoint"
    endpoint = settings.otlp_traces_endpoint
    if not endpoint:  # the variable the exporter itself reads
        name = next(n for n in _ENDPOINT_ENV if environ.get(n, "").strip())
        endpoint = environ[name]
    problem = _endpoint_problem(endpoint.strip(), chosen)
    if problem is not None:
        raise ValueError(f"{name} {endpoint!r}: {problem}")


def _endpoint_problem(endpoint: str, chosen: str) -> str | None:
    """Why ``endpoint`` is no URL the ``chosen`` exporter can send to, or None."""
    want = (
        "http://HOST:PORT/v1/traces (http/protobuf)"
        if chosen == HTTP
        else "http://HOST:PORT or HOST:PORT (gRPC)"
    )
    if chosen == GRPC and "://" not in endpoint:
        host, sep, port = endpoint.rpartition(":")
        if sep and host and port.isdigit():
            return None
        return f"expected {want}"
    parts = urlsplit(endpoint)
    schemes = ("http", "https") if chosen == HTTP else ("http", "https", "grpc")
    if parts.scheme not in schemes:
        return f"expected {want}"
    try:
        _ = parts.port  # reading it validates it
    except ValueError:
        return f"the port is not a number; expected {want}"
    if not parts.hostname:
        return f"no host; expected {want}"
    return None


def _otlp_exporter(settings: TracingSettings, environ: Mapping[str, str]) -> SpanExporter:
    check(settings, environ)
    # None: the exporter reads OTEL_EXPORTER_OTLP_*
    endpoint = (settings.otlp_traces_endpoint or "").strip() or None
    if protocol(settings, environ) == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def _ns(perf: float) -> int:
    """A ``time.perf_counter()`` reading as the wall-clock nanoseconds spans are dated in."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


class Tracing:
    """The router's tracer and the spans it makes; one per router process."""

    def __init__(self, provider: TracerProvider, exporter: SpanExporter | None = None) -> None:
        """``exporter``: the batched exporter ``shutdown`` must stop in time."""
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.exporter = exporter
        self.tracer = provider.get_tracer("switchyard.router")
        self._context = context
        self._trace = trace
        self._server_kind = SpanKind.SERVER
        self._client_kind = SpanKind.CLIENT
        self._error = Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()

    def shutdown(self, flush_s: float = SHUTDOWN_FLUSH_S) -> None:
        """Export what is still batched for up to ``flush_s``, then stop: an exporter whose
        collector is down retries for its whole timeout (10 s by default), which would hold
        the router's exit past its shutdown window."""
        if self.exporter is not None:
            # The SDK's flush exports on the calling thread, through every retry: a thread
            # of its own, waited for up to flush_s.
            flush = threading.Thread(target=self.provider.force_flush, daemon=True)
            flush.start()
            flush.join(flush_s)
            self.exporter.shutdown()  # ends a retry's back-off at once
        self.provider.shutdown()

    # -- the request ---------------------------------------------------------------------

    def request(
        self, route: str, headers: Mapping[str, str], request_id: str, started: float
    ) -> RequestTrace:
        """The server span of a request on ``route`` (the current span until ``end``),
        child of the client's ``traceparent`` in ``headers``; ``started``: perf_counter."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(
            f"POST {route}",
            context=parent or self._context.Context(),
            kind=self._server_kind,
            attributes={
                "http.request.method": "POST",
                "http.route": route,
                "url.path": route,
                "gen_ai.operation.name": _OPERATIONS.get(route, route),
                "switchyard.request_id": request_id,
            },
            start_time=_ns(started),
        )
        ctx = self._trace.set_span_in_context(span, parent)
        token = self._context.attach(ctx)
        return RequestTrace(self, span, token, _SERVER_SPAN.set(span))

    @staticmethod
    def recording() -> bool:
        """Whether the request being routed is sampled: if not, its children are not made
        (the engine is still told, by the server span's own traceparent)."""
        server = _SERVER_SPAN.get()
        return server is not None and server.is_recording()

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """An internal span, current inside the block; an exception marks it failed.
        A sampled-out request gets the invalid span, which records nothing."""
        if not self.recording():
            yield self._trace.INVALID_SPAN
            return
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def describe_schedule(
        self, span: Span, policy: str, ctx: Context, ranked: list[Worker]
    ) -> None:
        """What the scheduling cycle saw and chose, on its span."""
        first = ranked[0]
        attributes: dict[str, Any] = {
            "switchyard.policy": policy,
            "switchyard.schedule.worker": first.id,
            "switchyard.schedule.order": [w.id for w in ranked[:_MAX_LISTED]],
            "switchyard.schedule.reason": ctx.reason
            or ("prefix" if ctx.matched.get(first.id, 0.0) > 0 else "load"),
            "switchyard.schedule.prompt_tokens": ctx.prompt_tokens,
            "switchyard.schedule.predicted_cached_tokens": int(ctx.matched.get(first.id, 0.0)),
        }
        explain: Explanation | None = ctx.explain
        if explain is not None:
            attributes["switchyard.schedule.candidates"] = explain.candidates
            if len(explain.workers) <= _MAX_LISTED:
                attributes["switchyard.schedule.scored"] = explain.workers
                for scorer, values in explain.scores.items():
                    attributes[f"switchyard.schedule.score.{scorer}"] = values
        span.set_attributes(attributes)

    def mark(self, name: str, began: float, ended: float, attributes: dict[str, Any]) -> None:
        """A span for a stretch measured after the fact (perf_counter readings), a child of
        the current span."""
        if not self.recording():
            return
        span = self.tracer.start_span(name, attributes=attributes, start_time=_ns(began))
        span.end(end_time=_ns(ended))

    # -- upstream calls --------------------------------------------------------------------

    def client(self, url: str, path: str, worker: Worker, rank: int | None) -> Span | None:
        """The CLIENT span of one call to ``worker``, child of the current span; None when
        the request is sampled out (or no request is being routed: a background call)."""
        if not self.recording():
            return None
        host, _, port = url.partition("://")[2].partition("/")[0].rpartition(":")
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "url.full": url,
            "server.address": host or port,
            "switchyard.worker": worker.id,
        }
        if host and port.isdigit():
            attributes["server.port"] = int(port)
        if rank is not None:
            attributes["switchyard.dp_rank"] = rank
        return self.tracer.start_span(f"POST {path}", kind=self._client_kind, attributes=attributes)

    def inject(self, span: Span | None, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with a traceparent whose parent is ``span`` (None: the current span;
        the client's ``tracestate`` goes on unchanged: it travels in the span's context)."""
        out = dict(headers)
        context = None if span is None else self._trace.set_span_in_context(span)
        self._propagator.inject(out, context)
        return out

    def end_client(self, span: Span, status: int | None, outcome: str) -> None:
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("switchyard.outcome", outcome)
        if outcome not in ("success", "client_abort") or (status or 0) >= 500:
            span.set_status(self._error)
        span.end()

    def usage(self, span: Span | None, usage: Usage) -> None:
        """The engine's token counts, from its answer's ``usage``, on ``span`` (the
        attempt) and on the request's server span."""
        if span is None:  # sampled out
            return
        attributes = {"gen_ai.usage.input_tokens": usage.prompt}
        if usage.output is not None:
            attributes["gen_ai.usage.output_tokens"] = usage.output
        server = _SERVER_SPAN.get()
        for target in (span, server):
            if target is not None:
                target.set_attributes(attributes)


class RequestTrace:
    """One traced request: its server span, current until ``end``."""

    __slots__ = ("tracing", "span", "_token", "_server_token")

    def __init__(
        self,
        tracing: Tracing,
        span: Span,
        token: Token[OtelContext],
        server_token: Token[Span | None],
    ) -> None:
        self.tracing = tracing
        self.span = span
        self._token = token
        self._server_token = server_token

    def describe(self, model: str, tenant: str, priority: str) -> None:
        if not self.span.is_recording():
            return
        self.span.set_attributes(
            {
                "gen_ai.request.model": model,
                "switchyard.tenant": tenant,
                "switchyard.priority": priority,
            }
        )

    async def queued(self, wait: Awaitable[Grant]) -> Grant:
        """``wait`` (flow control's admission); a ``queue`` span if the request waited."""
        began = time.perf_counter()
        try:
            grant = await wait
        except asyncio.CancelledError:
            self._queue_span(began, "client_gone")
            raise
        except RouterError as exc:
            if exc.code == "queue_timeout":
                self._queue_span(began, exc.code)
            raise
        if grant.starting:  # dispatched from the queue rather than granted on arrival
            self._queue_span(began, "dispatched")
        return grant

    def _queue_span(self, began: float, outcome: str) -> None:
        attributes = {"switchyard.queue.outcome": outcome}
        self.tracing.mark("queue", began, time.perf_counter(), attributes)

    def end(self, status: int, worker_id: str) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("switchyard.worker", worker_id)
        if status >= 500:
            span.set_status(self.tracing._error)
        span.end()
        _SERVER_SPAN.reset(self._server_token)
        self.tracing._context.detach(self._token)


# -- JSON logs -----------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the request id and trace
    id of a line logged while a request is routed (for log pipelines that join on them)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            line["request_id"] = request_id
        span = _SERVER_SPAN.get()
        if span is not None:
            context = span.get_span_context()
            if context.is_valid:
                line["trace_id"] = f"{context.trace_id:032x}"
                line["span_id"] = f"{context.span_id:016x}"
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()
