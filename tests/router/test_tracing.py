"""OpenTelemetry tracing of routed requests: the span tree, what the engine is told, sampling,
what is never traced, and that tracing off costs no OpenTelemetry at all.

The router runs in-process with an in-memory exporter (spans exported as they end), in
front of a stub engine that answers with a usage block and keeps the headers it got.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from switchyard.core.cliopts import settings_command
from switchyard.router.cli import ALIASES
from switchyard.router.server import _uvicorn_options
from switchyard.router.settings import RouterSettings
from switchyard.router.settings import Tracing as TracingSettings
from switchyard.router.tracing import REQUEST_ID, JsonFormatter, build_tracing, enabled
from tests.pd.support_pd import LONG_PROMPT, MODEL, pd_router, running_mock, vllm_pair
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.support import free_port

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


class Engine:
    """A stub engine answering chats with ``USAGE``; ``seen`` holds each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.delay_s = 0.0
        self.backend = StubBackend(route=self._route)

    async def _route(self, request: StubRequest) -> StubReply | None:
        if request.method != "POST":
            return None
        self.seen.append(request.headers)
        await asyncio.sleep(self.delay_s)
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [], "usage": USAGE}
        return StubReply.json(answer)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    async with e.backend:
        yield e


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def traced(router: InProcessRouter, exporter: InMemorySpanExporter, ratio: float = 1.0) -> None:
    """Trace ``router``'s requests into ``exporter`` at ``ratio``."""
    settings = TracingSettings(sample_ratio=ratio)
    router.app.set_tracing(build_tracing(settings, environ={}, exporter=exporter))


@pytest.fixture
async def router(engine: Engine, spans: InMemorySpanExporter) -> AsyncIterator[InProcessRouter]:
    async with running_router(engine.backend.url, policy="kv_aware") as r:
        traced(r, spans)
        yield r


async def chat(router: InProcessRouter, **headers: str) -> dict[str, Any]:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hello there"}]}
    resp = await router.post(CHAT, json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return orjson.loads(resp.content)


def named(spans: InMemorySpanExporter, name: str) -> ReadableSpan:
    """The one finished span called ``name``."""
    [span] = [s for s in spans.get_finished_spans() if s.name == name]
    return span


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


async def test_a_request_is_a_server_span_over_schedule_and_one_client_span(
    router: InProcessRouter, spans: InMemorySpanExporter
) -> None:
    await chat(router, traceparent=TRACEPARENT, tracestate="vendor=abc", **{"x-priority": "high"})
    finished = spans.get_finished_spans()
    assert sorted((s.name, s.kind.name) for s in finished) == [
        (f"POST {CHAT}", "CLIENT"),
        (f"POST {CHAT}", "SERVER"),
        ("schedule", "INTERNAL"),
    ]
    server = next(s for s in finished if s.kind is SpanKind.SERVER)
    client = next(s for s in finished if s.kind is SpanKind.CLIENT)
    schedule = next(s for s in finished if s.name == "schedule")
    # The client's trace goes on: the server span is the child of its traceparent.
    assert trace_id(server) == int(TRACE_ID, 16)
    assert parent_id(server) == int(CLIENT_SPAN_ID, 16)
    assert server.parent is not None and server.parent.is_remote
    assert parent_id(schedule) == parent_id(client) == span_id(server)
    assert {trace_id(schedule), trace_id(client)} == {int(TRACE_ID, 16)}
    attributes = server.attributes or {}
    assert attributes["http.route"] == CHAT
    assert attributes["gen_ai.request.model"] == "stub-model"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["switchyard.tenant"] == "default"
    assert attributes["switchyard.priority"] == "high"
    assert len(str(attributes["switchyard.request_id"])) == 32
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.usage.input_tokens"] == 11
    assert attributes["gen_ai.usage.output_tokens"] == 3


async def test_the_engine_gets_a_traceparent_whose_parent_is_the_client_span(
    router: InProcessRouter, engine: Engine, spans: InMemorySpanExporter
) -> None:
    await chat(router, traceparent=TRACEPARENT, tracestate="vendor=abc")
    client = next(s for s in spans.get_finished_spans() if s.kind is SpanKind.CLIENT)
    version, trace, parent, flags = engine.seen[0]["traceparent"].split("-")
    assert (version, trace, flags) == ("00", TRACE_ID, "01")
    assert int(parent, 16) == span_id(client) != int(CLIENT_SPAN_ID, 16)
    assert engine.seen[0]["tracestate"] == "vendor=abc"
    attributes = client.attributes or {}
    assert attributes["url.full"] == engine.backend.url + CHAT
    assert attributes["server.port"] == engine.backend.port
    assert attributes["http.response.status_code"] == 200
    assert attributes["switchyard.outcome"] == "success"
    assert attributes["gen_ai.usage.output_tokens"] == 3


async def test_a_request_without_traceparent_starts_a_trace(
    router: InProcessRouter, engine: Engine, spans: InMemorySpanExporter
) -> None:
    await chat(router)
    server = next(s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert server.parent is None
    assert engine.seen[0]["traceparent"].split("-")[1] == f"{trace_id(server):032x}"


async def test_the_schedule_span_names_candidates_scores_and_choice(
    router: InProcessRouter, engine: Engine, spans: InMemorySpanExporter
) -> None:
    await chat(router)
    attributes = named(spans, "schedule").attributes or {}
    assert attributes["switchyard.policy"] == "kv_aware"
    assert attributes["switchyard.schedule.candidates"] == 1
    assert attributes["switchyard.schedule.worker"] == engine.backend.url
    assert attributes["switchyard.schedule.scored"] == (engine.backend.url,)
    scores = {k for k in attributes if k.startswith("switchyard.schedule.score.")}
    assert scores, "each scorer's values are on the span"
    assert all(len(attributes[k]) == 1 for k in scores)  # type: ignore[arg-type]
    assert attributes["switchyard.schedule.predicted_cached_tokens"] == 0


async def test_health_and_metrics_are_never_traced(
    router: InProcessRouter, spans: InMemorySpanExporter
) -> None:
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        await router.get(path)
    assert spans.get_finished_spans() == ()


async def test_at_ratio_0_a_request_without_a_sampled_parent_makes_no_span(
    router: InProcessRouter, engine: Engine, spans: InMemorySpanExporter
) -> None:
    traced(router, spans, ratio=0.0)
    await chat(router)
    assert spans.get_finished_spans() == ()
    flags = int(engine.seen[0]["traceparent"].rsplit("-", 1)[1], 16)
    assert not flags & 1  # the engine is told: not sampled
    await chat(router, traceparent=TRACEPARENT)  # a sampled parent decides for its own
    assert len(spans.get_finished_spans()) == 3


async def test_a_request_that_waited_in_the_queue_has_a_queue_span(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    config = {"router": {"flow": {"max_inflight_per_worker": 1}}}
    async with running_router(engine.backend.url, config=config) as router:
        traced(router, spans)
        engine.delay_s = 0.2
        await asyncio.gather(chat(router), chat(router))
    queued = [s for s in spans.get_finished_spans() if s.name == "queue"]
    assert len(queued) == 1, "one of the two waited for the other"
    servers = {span_id(s): s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER}
    assert parent_id(queued[0]) in servers
    assert (queued[0].attributes or {})["switchyard.queue.outcome"] == "dispatched"
    assert queued[0].end_time is not None and queued[0].start_time is not None
    assert queued[0].end_time > queued[0].start_time


async def test_tracing_off_makes_no_tracer_and_forwards_the_client_traceparent(
    engine: Engine,
) -> None:
    async with running_router(engine.backend.url) as router:
        assert router.app.tracing is None and router.app.forwarder.tracing is None
        await chat(router, traceparent=TRACEPARENT)
    assert engine.seen[0]["traceparent"] == TRACEPARENT


def test_tracing_off_loads_no_tracing_sdk_or_exporter() -> None:
    """In a fresh interpreter, so what this test process imported does not count. (The
    OpenTelemetry API itself may be loaded: redis-py imports it where it is installed.)"""
    code = (
        "import sys\n"
        "from switchyard.router.server import build_app\n"
        "from switchyard.router.settings import RouterSettings\n"
        "app = build_app(RouterSettings.load(None, workers=['http://127.0.0.1:9']))\n"
        "assert app.tracing is None\n"
        "sdk = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "print(sorted(m for m in sys.modules if m.startswith(sdk)))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_tracing_is_on_with_an_endpoint_from_the_settings_or_the_otel_environment() -> None:
    off = TracingSettings()
    assert not enabled(off, {})
    assert enabled(TracingSettings(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces"), {})
    assert enabled(off, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318"})
    assert enabled(off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not enabled(
        off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    )


def test_the_endpoint_flag_is_spelled_as_vllm_spells_it() -> None:
    seen: list[RouterSettings] = []
    cmd = settings_command(
        "router", RouterSettings, lambda s, _: seen.append(s), help="", aliases=ALIASES
    )
    argv = ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    argv += ["--tracing-sample-ratio", "0.1", "--log-format", "json"]
    result = CliRunner().invoke(cmd, argv)
    assert result.exit_code == 0, result.output
    assert seen[0].tracing.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert seen[0].tracing.sample_ratio == 0.1
    assert seen[0].log_format == "json"


async def test_a_disaggregated_request_has_prefill_decode_and_transfer_spans(
    spans: InMemorySpanExporter,
) -> None:
    async with vllm_pair() as (front, _, _):
        traced(front.router, spans)
        stream = await front.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": LONG_PROMPT}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        [c async for c in stream]
    finished = spans.get_finished_spans()
    server = next(s for s in finished if s.kind is SpanKind.SERVER)
    legs = {s.name: s for s in finished if s.kind is SpanKind.INTERNAL}
    assert {"prefill", "decode", "kv_transfer"} <= set(legs)
    assert {parent_id(legs[n]) for n in ("prefill", "decode", "kv_transfer")} == {span_id(server)}
    clients = {parent_id(s): s for s in finished if s.kind is SpanKind.CLIENT}
    assert set(clients) == {span_id(legs["prefill"]), span_id(legs["decode"])}
    assert (server.attributes or {})["gen_ai.usage.output_tokens"] == 3


async def test_an_image_chat_has_an_encode_span_before_its_prefill(
    spans: InMemorySpanExporter,
) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": LONG_PROMPT}]}]
    async with (
        running_mock(role="encode") as encoder,
        running_mock(role="prefill") as prefill,
        running_mock(role="decode") as decode,
        pd_router("vllm", prefill=[prefill], decode=[decode], encode=[encoder]) as front,
    ):
        traced(front.router, spans)
        await front.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    encode, first = named(spans, "encode"), named(spans, "prefill")
    server = next(s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert parent_id(encode) == parent_id(first) == span_id(server)
    assert (encode.attributes or {})["switchyard.images"] == 1
    [call] = [s for s in spans.get_finished_spans() if parent_id(s) == span_id(encode)]
    assert call.kind is SpanKind.CLIENT
    assert encode.end_time is not None and first.start_time is not None
    assert encode.end_time <= first.start_time


class Lines(logging.Handler):
    """Formats each record as it is logged, in the logging call's context."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def router_log() -> Iterator[Lines]:
    logger = logging.getLogger("switchyard.router")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_a_json_line_logged_while_routing_names_the_request_and_its_trace(
    engine: Engine, spans: InMemorySpanExporter, router_log: Lines
) -> None:
    async with running_router(engine.backend.url, log_format="json") as router:
        traced(router, spans)
        resp = await router.post(
            CHAT,
            json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-request-id": "req-42", "traceparent": TRACEPARENT},
        )
        assert resp.status_code == 200
    during = [line for line in router_log.lines if line.get("request_id") == "req-42"]
    assert during, "the scheduling decision's debug line is logged inside the request"
    assert {line["trace_id"] for line in during} == {TRACE_ID}


def test_json_log_lines_have_time_level_logger_and_message() -> None:
    record = logging.LogRecord(
        "switchyard.router", logging.WARNING, "x", 1, "odd %s", ("one",), None
    )
    token = REQUEST_ID.set("req-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["level"] == "WARNING" and line["logger"] == "switchyard.router"
    assert line["message"] == "odd one" and line["request_id"] == "req-1"
    assert line["time"].endswith("+00:00")
    assert "request_id" not in json.loads(JsonFormatter().format(record))


def test_json_logs_hand_uvicorn_s_lines_to_the_root_handler() -> None:
    json_logs = RouterSettings.load(None, log_format="json")
    assert _uvicorn_options(json_logs)["log_config"] is None
    assert "log_config" not in _uvicorn_options(RouterSettings.load(None))


def test_a_stopping_router_does_not_wait_out_a_dead_collector_s_retries() -> None:
    """The exporter retries a refused collector for its whole timeout (10 s by default)."""
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"
    tracing = build_tracing(TracingSettings(otlp_traces_endpoint=dead), environ={})
    assert tracing is not None
    tracing.tracer.start_span("lost").end()
    began = time.monotonic()
    tracing.shutdown(flush_s=0.2)
    assert time.monotonic() - began < 3.0


GRPC = "grpc"


@pytest.mark.parametrize(
    ("settings", "environ", "module"),
    [
        (TracingSettings(), {}, "http"),
        (TracingSettings(protocol="grpc"), {}, "grpc"),
        (TracingSettings(), {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "grpc"),
        (
            TracingSettings(protocol="http/protobuf"),
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "http",
        ),
    ],
)
def test_the_protocol_comes_from_the_setting_else_the_otel_environment(
    settings: TracingSettings, environ: dict[str, str], module: str
) -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}
    tracing = build_tracing(settings, environ={**environ, **endpoint})
    assert tracing is not None and tracing.exporter is not None
    try:
        assert f".proto.{module}." in type(tracing.exporter).__module__
    finally:
        tracing.shutdown(flush_s=0)
