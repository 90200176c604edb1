"""One request's trace across the router and real vLLM-CPU engines, printed as a tree.

An OTLP/HTTP receiver in this process (``OtlpReceiver``: protobuf ``ExportTraceServiceRequest``
bodies, decoded with ``opentelemetry-proto``) takes the spans of both: the router exports to
it (``--otlp-traces-endpoint``) and so do the engines (vLLM's own flag, over http/protobuf).
One chat completion goes through the router with a client ``traceparent``; the tree of that
trace is printed with each span's service, kind and duration.

    python -m bench.trace_tree          # one engine, the unified path
    python -m bench.trace_tree --pd     # a prefill and a decode engine (NixlConnector)

``tests/real/test_real_tracing.py`` runs the same pieces and asserts the tree.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from switchyard.loadtest.procs import Server, free_port
from tools.realvllm import EngineOptions, VllmEngine, build_model, launch_engine, wait_healthy

MODEL = "switchyard-llama"
MAX_MODEL_LEN = 2048
# Export each batch this soon (ms; the SDK's default is 5 s), so a trace is whole quickly.
EXPORT_DELAY_MS = "200"
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def decode(body: bytes) -> list[Span]:
    """The spans of one OTLP/HTTP protobuf export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[Span] = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    Span(
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.name,
                        _KINDS.get(s.kind, str(s.kind)),
                        service,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                    )
                )
    return spans


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback, in a thread of its own, keeping every span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                received = decode(body)
                with receiver._lock:
                    receiver.spans.extend(received)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.traces_url = self.url + "/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, *names: str, timeout_s: float = 60.0) -> list[Span]:
        """The trace's spans once it holds a span of each of ``names`` (a name given twice:
        two spans of that name)."""
        wanted = Counter(names)
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            missing = wanted - Counter(s.name for s in spans)
            if not missing:
                return spans
            if time.monotonic() > deadline:
                got = sorted(s.name for s in spans)
                raise TimeoutError(f"trace {trace_id}: no {sorted(missing)} in {got}")
            time.sleep(0.05)


def tree_lines(spans: list[Span]) -> list[str]:
    """The spans of one trace as an indented tree: name, service, kind, parent, duration."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            label = f"{'  ' * depth}{s.name}"
            lines.append(
                f"{label:<44} {s.service:<18} {s.kind:<8} span {s.span_id} "
                f"parent {s.parent_id or '-':<16} {s.duration_ms:9.2f} ms"
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return lines


@contextlib.contextmanager
def traced_engines(
    model: Path, receiver: OtlpReceiver, roles: list[str], log_dir: Path, nixl: bool
) -> Iterator[list[VllmEngine]]:
    """vLLM engines, one per role (named ``vllm-<role>`` as a service), exporting their
    ``llm_request`` spans to ``receiver`` over http/protobuf."""
    opts = EngineOptions(
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
        nixl=nixl,
        extra_args=["--otlp-traces-endpoint", receiver.traces_url],
    )
    engines: list[VllmEngine] = []
    saved = dict(os.environ)
    cores = sorted(os.sched_getaffinity(0))
    try:
        for i, role in enumerate(roles):
            os.environ.update(
                OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
                OTEL_SERVICE_NAME=f"vllm-{role}",
                OTEL_BSP_SCHEDULE_DELAY=EXPORT_DELAY_MS,
            )
            engines.append(launch_engine(model, str(cores[i % len(cores)]), opts, log_dir))
        os.environ.clear()
        os.environ.update(saved)
        wait_healthy(engines, timeout_s=800)
        yield engines
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for e in engines:
            e.stop()


def traced_router(receiver: OtlpReceiver, worker_args: list[str], *extra: str) -> Server:
    """``switchyard router`` (one process) exporting its spans to ``receiver``."""
    port = free_port()
    argv = ["router", "--port", str(port), "--processes", "1", "--no-kv-parity"]
    argv += ["--otlp-traces-endpoint", receiver.traces_url, *worker_args, *extra]
    # A first request on vLLM-CPU (a P/D pair's first NIXL transfer among them) can take
    # longer than the default first-byte deadline on a busy machine; a trace needs its answer.
    env = dict(
        os.environ,
        OTEL_BSP_SCHEDULE_DELAY=EXPORT_DELAY_MS,
        SWITCHYARD_ROUTER_TIMEOUTS__FIRST_BYTE_BASE_S="120",
    )
    return Server(argv, port, "/ready", env=env).start(timeout=180)


def traced_chat(router_url: str, stream: bool = False) -> str:
    """One chat completion through the router with a fresh client traceparent; its trace id."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Trace me " + secrets.token_hex(8) * 20}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    resp = httpx.post(router_url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    resp.raise_for_status()
    return trace_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pd", action="store_true", help="a prefill and a decode engine (NIXL)")
    ap.add_argument("--stream", action="store_true", help="a streamed chat completion")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="switchyard-trace-") as tmp, OtlpReceiver() as rx:
        model = build_model(Path(tmp) / "model", "tiny", MAX_MODEL_LEN)
        roles = ["prefill", "decode"] if args.pd else ["engine"]
        with traced_engines(model, rx, roles, Path(tmp), nixl=args.pd) as engines:
            if args.pd:
                workers = ["--pd-protocol", "vllm", "--prefill", engines[0].url]
                workers += ["--decode", engines[1].url]
            else:
                workers = ["--worker", engines[0].url]
            router = traced_router(rx, workers)
            try:
                trace_id = traced_chat(router.url, args.stream)
                legs = ("prefill", "decode", "llm_request") if args.pd else ()
                spans = rx.wait_for(trace_id, "POST /v1/chat/completions", "llm_request", *legs)
            finally:
                router.stop()
    print(f"trace {trace_id}")
    print("\n".join(tree_lines(spans)))


if __name__ == "__main__":
    main()
