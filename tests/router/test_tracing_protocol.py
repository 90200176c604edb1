"""Which OTLP protocol the router's traces go over, read from ``--otlp-traces-endpoint`` as
vLLM reads the same flag: gRPC, unless the URL ends in ``/v1/traces`` (http/protobuf) or
``--tracing-protocol`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` say otherwise. A set-up that
could never export stops the start in one line.

The receivers are real: an OTLP/gRPC TraceService served with grpcio and an OTLP/HTTP
endpoint, both in this process, each keeping the names of the spans it was sent.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from switchyard.cli.main import run
from switchyard.router.settings import Tracing as TracingSettings
from switchyard.router.tracing import GRPC, HTTP, build_tracing, check, protocol
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def span_names(request: trace_service_pb2.ExportTraceServiceRequest) -> list[str]:
    return [
        span.name
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector: the TraceService of opentelemetry-proto, served by grpcio."""

    def __init__(self) -> None:
        self.spans: list[str] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{port}"

    def Export(  # noqa: N802 (the service's method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans.extend(span_names(request))
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self) -> GrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


class HttpReceiver:
    """An OTLP/HTTP collector on loopback: protobuf bodies POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[str] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.spans.extend(span_names(request))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HttpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(autouse=True)
def no_otel_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag alone decides, whatever this machine's environment says."""
    for name in (*PROTOCOL_ENV, *ENDPOINT_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def engine() -> AsyncIterator[StubBackend]:
    async with StubBackend() as stub:
        yield stub


@pytest.fixture
def grpc_receiver() -> Iterator[GrpcReceiver]:
    with GrpcReceiver() as receiver:
        yield receiver


@pytest.fixture
def http_receiver() -> Iterator[HttpReceiver]:
    with HttpReceiver() as receiver:
        yield receiver


async def one_traced_chat(engine: StubBackend, endpoint: str) -> None:
    """A router with only ``--otlp-traces-endpoint endpoint`` routes one chat; its spans are
    exported (flushed) before it stops."""
    tracing = {"otlp_traces_endpoint": endpoint}
    async with running_router(engine.url, config={"router": {"tracing": tracing}}) as router:
        await chat(router)
        assert router.app.tracing is not None
        assert router.app.tracing.provider.force_flush(timeout_millis=20_000)


async def chat(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hello there"}]}
    resp = await router.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text


async def test_an_endpoint_without_the_traces_path_is_sent_over_grpc(
    engine: StubBackend, grpc_receiver: GrpcReceiver
) -> None:
    await one_traced_chat(engine, grpc_receiver.url)
    assert f"POST {CHAT}" in grpc_receiver.spans and "schedule" in grpc_receiver.spans


async def test_an_endpoint_ending_in_the_traces_path_is_sent_over_http(
    engine: StubBackend, http_receiver: HttpReceiver
) -> None:
    await one_traced_chat(engine, http_receiver.url + "/v1/traces")
    assert f"POST {CHAT}" in http_receiver.spans and "schedule" in http_receiver.spans
    assert set(http_receiver.paths) == {"/v1/traces"}


@pytest.mark.parametrize(
    ("settings", "environ", "expected"),
    [
        (TracingSettings(otlp_traces_endpoint="http://collector:4317"), {}, GRPC),
        (TracingSettings(otlp_traces_endpoint="grpc://collector:4317"), {}, GRPC),
        (TracingSettings(otlp_traces_endpoint="collector:4317"), {}, GRPC),
        (TracingSettings(otlp_traces_endpoint="http://collector:4318/v1/traces"), {}, HTTP),
        (TracingSettings(otlp_traces_endpoint="https://collector/otlp/v1/traces/"), {}, HTTP),
        (
            TracingSettings(otlp_traces_endpoint="http://collector:4318/v1/traces", protocol=GRPC),
            {},
            GRPC,
        ),
        (
            TracingSettings(otlp_traces_endpoint="http://collector:4318"),
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": HTTP},
            HTTP,
        ),
        (
            TracingSettings(otlp_traces_endpoint="http://collector:4318/v1/traces"),
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": GRPC},
            GRPC,
        ),
        # An endpoint from OpenTelemetry's own variables keeps its default.
        (TracingSettings(), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, HTTP),
    ],
)
def test_the_protocol_is_read_from_the_endpoint_as_vllm_reads_it(
    settings: TracingSettings, environ: dict[str, str], expected: str
) -> None:
    assert protocol(settings, environ) == expected


@pytest.mark.parametrize(
    ("endpoint", "protocol_flag", "message"),
    [
        ("collector", None, "expected http://HOST:PORT or HOST:PORT (gRPC)"),
        ("http://collector:port", None, "the port is not a number"),
        ("http:///v1/traces", None, "no host"),
        ("collector:4318/v1/traces", None, "expected http://HOST:PORT/v1/traces"),
        ("grpc://collector:4317", HTTP, "expected http://HOST:PORT/v1/traces"),
    ],
)
def test_an_endpoint_that_is_no_url_stops_the_start_in_one_line(
    capsys: pytest.CaptureFixture[str], endpoint: str, protocol_flag: str | None, message: str
) -> None:
    argv = ["router", "--worker", "http://127.0.0.1:9", "--otlp-traces-endpoint", endpoint]
    if protocol_flag is not None:
        argv += ["--tracing-protocol", protocol_flag]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "tracing.otlp_traces_endpoint" in err and message in err


def test_grpc_without_its_exporter_stops_the_start_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)
    argv = ["router", "--worker", "http://127.0.0.1:9"]
    assert run([*argv, "--otlp-traces-endpoint", "http://collector:4317"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "opentelemetry-exporter-otlp-proto-grpc" in err and "switchyard[otlp-grpc]" in err


def test_a_protocol_the_sdk_does_not_speak_is_refused() -> None:
    settings = TracingSettings(otlp_traces_endpoint="http://collector:4318/v1/traces")
    with pytest.raises(ValueError, match="OTLP protocol 'http/json': use http/protobuf or grpc"):
        build_tracing(settings, environ={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


def test_nothing_is_checked_while_tracing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A set-up that would fail once on (gRPC, its exporter missing) passes while off."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    check(TracingSettings(protocol=GRPC), environ={})
    on = TracingSettings(protocol=GRPC, otlp_traces_endpoint="http://127.0.0.1:4317")
    with pytest.raises(ValueError, match="otlp-proto-grpc"):
        check(on, environ={})
