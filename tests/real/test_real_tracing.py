"""One trace across the router and real vLLM-CPU: the engine's ``llm_request`` span is the
child of the router's CLIENT span, which is the child of its SERVER span.

Two engines with NixlConnector export their spans (vLLM's ``--otlp-traces-endpoint``, over
http/protobuf) to an OTLP receiver in this process, and so does the router; the receiver
and the engine launcher are ``bench.trace_tree``'s. The decode engine alone serves the
unified path; both serve the P/D path. Run with ``-s`` to see each tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.trace_tree import (
    OtlpReceiver,
    Span,
    traced_chat,
    traced_engines,
    traced_router,
    tree_lines,
)
from tools.realvllm import VllmEngine

CHAT = "POST /v1/chat/completions"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def engines(
    tiny_model: Path, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """A prefill and a decode engine, stopped after this module (NIXL keeps a core busy)."""
    logs = tmp_path_factory.mktemp("vllm-tracing-logs")
    with traced_engines(tiny_model, receiver, ["prefill", "decode"], logs, nixl=True) as pair:
        yield pair


def show(title: str, spans: list[Span]) -> None:
    print(f"\n{title}\n" + "\n".join(tree_lines(spans)))


def one(spans: list[Span], name: str, kind: str, service: str) -> Span:
    [span] = [s for s in spans if (s.name, s.kind, s.service) == (name, kind, service)]
    return span


def test_the_engine_s_span_is_the_child_of_the_router_s_client_span(
    receiver: OtlpReceiver, engines: list[VllmEngine]
) -> None:
    decode = engines[1]
    router = traced_router(receiver, ["--worker", decode.url])
    try:
        trace_id = traced_chat(router.url)
        spans = receiver.wait_for(trace_id, CHAT, CHAT, "schedule", "llm_request")
    finally:
        router.stop()
    show("unified", spans)
    server = one(spans, CHAT, "SERVER", "switchyard-router")
    client = one(spans, CHAT, "CLIENT", "switchyard-router")
    engine = one(spans, "llm_request", "SERVER", "vllm-decode")
    assert client.parent_id == server.span_id
    assert engine.parent_id == client.span_id
    assert server.attributes["gen_ai.request.model"] == "switchyard-llama"
    assert server.attributes["gen_ai.usage.output_tokens"] == 4
    assert engine.start_ns >= client.start_ns and engine.end_ns <= client.end_ns + 50_000_000


def test_a_disaggregated_trace_holds_both_engines_spans_under_their_legs(
    receiver: OtlpReceiver, engines: list[VllmEngine]
) -> None:
    prefill, decode = engines
    workers = ["--pd-protocol", "vllm", "--prefill", prefill.url, "--decode", decode.url]
    router = traced_router(receiver, workers)
    try:
        trace_id = traced_chat(router.url, stream=True)
        legs = ("prefill", "decode", "kv_transfer", CHAT, CHAT, CHAT)
        spans = receiver.wait_for(trace_id, *legs, "llm_request", "llm_request")
    finally:
        router.stop()
    show("prefill/decode", spans)
    server = one(spans, CHAT, "SERVER", "switchyard-router")
    for leg in ("prefill", "decode"):
        span = one(spans, leg, "INTERNAL", "switchyard-router")
        assert span.parent_id == server.span_id
        below = [s for s in spans if s.parent_id == span.span_id]
        client = one(below, CHAT, "CLIENT", "switchyard-router")
        engine = one(spans, "llm_request", "SERVER", f"vllm-{leg}")
        assert engine.parent_id == client.span_id
    assert one(spans, "kv_transfer", "INTERNAL", "switchyard-router").parent_id == server.span_id
