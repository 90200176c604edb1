"""The mock engine's OpenAI API, as real clients see it: shapes, token accounting, errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import Server, eventually, free_port, metric

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "openai"
MODEL = "mock-model"


def shape(value: Any) -> Any:
    """Keys and JSON types, not values: what a client's parser depends on."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]


def golden_events(name: str) -> list[str]:
    return sse_events((GOLDEN / name).read_text())


def golden(name: str) -> Any:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="module")
def engine() -> Iterator[Server]:
    port = free_port()
    with Server(["mock", "--port", str(port), "--model", MODEL, "--speed", "20"], port) as srv:
        yield srv


@pytest.fixture(scope="module")
def realtime_engine() -> Iterator[Server]:
    """Speed 1: prefill of a long prompt takes tens of ms, so cache effects are visible."""
    port = free_port()
    with Server(["mock", "--port", str(port), "--model", MODEL, "--speed", "1"], port) as srv:
        yield srv


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=20)


def test_completion_body_matches_golden(engine: Server) -> None:
    r = httpx.post(
        engine.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
    )
    assert r.status_code == 200
    assert shape(r.json()) == shape(golden("completion.json"))


def test_chat_body_matches_golden(engine: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert shape(r.json()) == shape(golden("chat_completion.json"))


def test_completion_stream_chunks_match_golden(engine: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(engine.url + "/v1/completions", json=body)
    got, want = sse_events(r.text), golden_events("completion_stream.txt")
    assert r.headers["content-type"].startswith("text/event-stream")
    assert got[-1] == "[DONE]" and want[-1] == "[DONE]"
    assert [shape(json.loads(e)) for e in got[:-1]] == [shape(json.loads(e)) for e in want[:-1]]


def test_chat_stream_chunks_match_golden(engine: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(engine.url + "/v1/chat/completions", json=body)
    got, want = sse_events(r.text), golden_events("chat_completion_stream.txt")
    assert got[-1] == "[DONE]"
    assert [shape(json.loads(e)) for e in got[:-1]] == [shape(json.loads(e)) for e in want[:-1]]


def test_openai_client_streams_chat_with_final_usage_chunk(engine: Server) -> None:
    stream = client(engine).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text == " the" * 5


def test_continuous_usage_stats_put_usage_on_every_chunk(engine: Server) -> None:
    stream = client(engine).completions.create(
        model=MODEL,
        prompt="count",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    completions = [c.usage.completion_tokens for c in chunks if c.choices]
    assert completions == sorted(completions) and completions[-1] == 4
    assert all(c.usage is not None for c in chunks)


def test_output_is_exactly_max_tokens_tokens(engine: Server) -> None:
    out = client(engine).completions.create(model=MODEL, prompt="go", max_tokens=37)
    counted = httpx.post(engine.url + "/tokenize", json={"prompt": out.choices[0].text}).json()
    assert out.usage.completion_tokens == 37
    assert counted["count"] == 37


def test_chat_accepts_content_parts_and_max_completion_tokens(engine: Server) -> None:
    out = client(engine).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
        max_completion_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 6
    assert out.choices[0].message.content == " the" * 6


def test_chat_prompt_tokens_follow_the_chat_template(engine: Server) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tok = httpx.post(engine.url + "/tokenize", json={"messages": messages}).json()
    out = client(engine).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == tok["count"]


def test_n_greater_than_one_is_a_clear_400(engine: Server) -> None:
    r = httpx.post(engine.url + "/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})
    assert r.status_code == 400
    assert shape(r.json()) == shape(golden("error.json"))
    assert "n=1" in r.json()["error"]["message"]


def test_bad_json_is_a_400_in_vllm_error_shape(engine: Server) -> None:
    r = httpx.post(
        engine.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


def test_unknown_model_is_a_404(engine: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client(engine).completions.create(model="other", prompt="x", max_tokens=1)


def test_x_request_id_is_echoed_and_used_as_the_id(engine: Server) -> None:
    r = httpx.post(
        engine.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "req-abc-123"},
    )
    assert r.headers["x-request-id"] == "req-abc-123"
    assert r.json()["id"] == "cmpl-req-abc-123"


def test_tokenize_and_detokenize_round_trip(engine: Server) -> None:
    tok = httpx.post(engine.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert shape(tok) == shape(golden("tokenize.json"))
    assert tok["count"] == len(tok["tokens"])
    back = httpx.post(engine.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": "hello world"}


def test_models_lists_the_served_model(engine: Server) -> None:
    r = httpx.get(engine.url + "/v1/models").json()
    assert shape(r) == shape(golden("models.json"))
    assert [m.id for m in client(engine).models.list()] == [MODEL]


def test_embeddings_are_deterministic_unit_vectors(engine: Server) -> None:
    a = client(engine).embeddings.create(model=MODEL, input="the same text")
    b = client(engine).embeddings.create(model=MODEL, input="the same text")
    raw = httpx.post(engine.url + "/v1/embeddings", json={"input": "x y"}).json()
    assert shape(raw) == shape(golden("embeddings.json"))
    assert a.data[0].embedding == b.data[0].embedding
    assert abs(sum(v * v for v in a.data[0].embedding) - 1.0) < 1e-6


def test_metrics_counters_agree_with_what_was_served(engine: Server) -> None:
    before = httpx.get(engine.url + "/metrics").text
    c = client(engine)
    usages = [
        c.completions.create(model=MODEL, prompt=f"request number {i}", max_tokens=3 + i).usage
        for i in range(4)
    ]
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "streamed"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append([ch for ch in stream][-1].usage)
    after = httpx.get(engine.url + "/metrics").text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total", finished_reason="length") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 5
    assert metric(after, "vllm:num_requests_running") == 0


def _ttft(c: openai.OpenAI, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    stream = c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft = 0.0
    cached = 0
    for chunk in stream:
        if chunk.choices and not ttft:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, cached


def test_repeated_prompt_hits_the_prefix_cache_and_starts_sooner(realtime_engine: Server) -> None:
    c = client(realtime_engine)
    prompt = " ".join(f"w{i}" for i in range(3000))
    cold, cold_cached = _ttft(c, prompt)
    warm, warm_cached = _ttft(c, prompt)
    assert cold_cached == 0
    assert warm_cached > 0
    assert warm < cold


def test_aborted_stream_frees_its_slot_and_is_not_counted_as_finished(
    realtime_engine: Server,
) -> None:
    before = metric(httpx.get(realtime_engine.url + "/metrics").text, "vllm:request_success_total")
    with httpx.stream(
        "POST",
        realtime_engine.url + "/v1/completions",
        json={"prompt": "long one", "max_tokens": 5000, "stream": True},
    ) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        running = metric(
            httpx.get(realtime_engine.url + "/metrics").text, "vllm:num_requests_running"
        )
        assert running == 1

    def idle_metrics() -> str | None:
        text = httpx.get(realtime_engine.url + "/metrics").text
        return text if metric(text, "vllm:num_requests_running") == 0 else None

    text = eventually(idle_metrics, 2.0, 0.02)
    assert metric(text, "vllm:request_success_total") == before  # as vLLM 0.32


def test_sglang_flavour_serves_its_own_control_endpoints() -> None:
    port = free_port()
    with Server(["mock", "--port", str(port), "--flavor", "sglang"], port) as srv:
        info = httpx.get(srv.url + "/get_model_info").json()
        health = httpx.get(srv.url + "/health_generate")
        flushed = httpx.post(srv.url + "/flush_cache")
        version = httpx.get(srv.url + "/version").json()
    assert info["model_path"] == "mock-model" and info["is_generation"] is True
    assert health.status_code == 200
    assert flushed.status_code == 200
    assert version["version"]


def test_concurrent_requests_reusing_one_request_id_both_complete(engine: Server) -> None:
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as c:
            body = {"prompt": "dup", "max_tokens": 30}
            headers = {"X-Request-Id": "same-id"}
            return await asyncio.gather(
                *(c.post(engine.url + "/v1/completions", json=body, headers=headers) for _ in "ab")
            )

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 30 for r in responses)


def test_load_counts_requests_in_flight(realtime_engine: Server) -> None:
    idle = httpx.get(realtime_engine.url + "/load").json()
    with httpx.stream(
        "POST",
        realtime_engine.url + "/v1/completions",
        json={"prompt": "busy", "max_tokens": 500, "stream": True},
    ) as r:
        lines = r.iter_lines()
        next(lines)
        busy = httpx.get(realtime_engine.url + "/load").json()
    assert idle == {"server_load": 0}
    assert busy == {"server_load": 1}
