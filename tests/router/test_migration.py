"""Mid-stream migration: a stream whose worker fails after its first byte resumes on another
worker, and the client sees one stream: the same id, no repeated or missing text, the
right finish and usage, ``max_tokens`` counted across workers, one ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.router.migration import Keeper
from switchyard.router.settings import Tracing as TracingSettings
from switchyard.router.tracing import build_tracing
from tests.router.conftest import StartRouter
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend
from tests.router.token_engine import MODEL, Fault, TokenEngine, render, tokenize
from tests.support import metric

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12, "stream": True}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "say something"}],
    "max_tokens": 12,
    "stream": True,
}
USAGE = {"stream_options": {"include_usage": True}}
ROUND_ROBIN = {"policy": "round_robin"}


@pytest.fixture
async def engines() -> AsyncIterator[tuple[TokenEngine, TokenEngine]]:
    """Two engines sharing their script and their record: a fault meets the next streamed
    request whichever engine it goes to, and ``bodies`` are all of them in order."""
    faults: list[Fault] = []
    bodies: list[dict[str, Any]] = []
    async with TokenEngine(faults, bodies=bodies) as one, TokenEngine(faults, bodies=bodies) as two:
        yield one, two


def events(body: bytes) -> list[Any]:
    """The stream's events: parsed chunks, "[DONE]" as a string."""
    out: list[Any] = []
    for event in body.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: "), event
            data = event[len(b"data: ") :]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def text(chunks: list[Any]) -> str:
    parts = []
    for chunk in chunks:
        if chunk == "[DONE]" or "error" in chunk:
            continue
        for choice in chunk["choices"]:
            parts.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
    return "".join(parts)


def finish(chunks: list[Any]) -> str | None:
    reasons = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c != "[DONE]" and c.get("choices") and c["choices"][0]["finish_reason"]
    ]
    assert len(reasons) <= 1, reasons
    return reasons[0] if reasons else None


async def stream(router: InProcessRouter, path: str, body: dict[str, Any]) -> list[Any]:
    resp = await router.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return events(resp.content)


async def uninterrupted(path: str, body: dict[str, Any]) -> list[Any]:
    async with TokenEngine() as engine, running_router(engine.url) as router:
        return await stream(router, path, body)


async def migrations(router: InProcessRouter, reason: str, outcome: str) -> float:
    text = (await router.get("/metrics")).text
    return metric(text, "switchyard_router_migrations_total", reason=reason, outcome=outcome)


def assert_one_stream(chunks: list[Any]) -> None:
    """One id, model and creation time throughout, no error, one [DONE] at the end."""
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    body = chunks[:-1]
    assert not any("error" in c for c in body), body
    assert len({(c["id"], c["model"], c["created"]) for c in body}) == 1


@pytest.mark.parametrize("fault", ["cut", "error", "stall"])
async def test_a_completion_stream_resumes_on_the_other_worker_after_a_failure(
    engines: tuple[TokenEngine, TokenEngine], fault: str
) -> None:
    one, two = engines
    one.faults.append(Fault(fault, 5))
    config = {"router": {"migration": {"stall_floor_s": 0.3}}}
    async with running_router(one.url, two.url, config=config, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", {**COMPLETION, **USAGE})
        reason = {"cut": "cut", "error": "error_event", "stall": "stall"}[fault]
        resumed = await migrations(router, reason, "resumed")
    assert resumed == 1
    assert_one_stream(chunks)
    expected = await uninterrupted("/v1/completions", {**COMPLETION, **USAGE})
    assert text(chunks) == text(expected)
    assert finish(chunks) == "length"
    assert chunks[-2]["usage"] == expected[-2]["usage"]
    assert chunks[-2]["usage"]["completion_tokens"] == 12
    # the continuation: the prompt's and the 5 generated ids, 7 tokens left
    _, continued = one.bodies
    prompt = tokenize(COMPLETION["prompt"])
    assert continued["prompt"][: len(prompt)] == prompt
    assert len(continued["prompt"]) == len(prompt) + 5
    assert continued["max_tokens"] == 7


async def test_a_chat_stream_resumes_as_chat_chunks_under_its_own_id(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 4))
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/chat/completions", {**CHAT, **USAGE})
    assert_one_stream(chunks)
    assert {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}
    roles = [c["choices"][0]["delta"].get("role") for c in chunks[:-1] if c["choices"]]
    assert roles.count("assistant") == 1
    expected = await uninterrupted("/v1/chat/completions", {**CHAT, **USAGE})
    assert text(chunks) == text(expected)
    assert finish(chunks) == "length"
    assert chunks[-2]["usage"] == expected[-2]["usage"]
    # continued as a completion of the rendered chat's ids and the 3 generated ones
    _, continued = one.bodies
    assert continued["prompt"][: len(render(CHAT["messages"]))] == render(CHAT["messages"])
    assert len(continued["prompt"]) == len(render(CHAT["messages"])) + 3
    assert continued["max_tokens"] == 9
    assert "messages" not in continued


async def test_a_migration_is_a_span_over_the_call_that_resumed_and_is_counted(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 5))
    exporter = InMemorySpanExporter()
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        router.app.set_tracing(build_tracing(TracingSettings(), environ={}, exporter=exporter))
        await stream(router, "/v1/completions", COMPLETION)
        text = (await router.get("/metrics")).text
    carried = len(tokenize(COMPLETION["prompt"])) + 5
    assert metric(text, "switchyard_router_migrated_tokens_total") == carried
    assert metric(text, "switchyard_router_migration_resume_seconds_count") == 1
    [span] = [s for s in exporter.get_finished_spans() if s.name == "switchyard.migrate"]
    assert span.attributes is not None
    assert span.attributes["switchyard.migration.reason"] == "cut"
    assert span.attributes["switchyard.migration.tokens"] == carried
    assert span.attributes["switchyard.worker"] != span.attributes["switchyard.migration.from"]
    assert span.context is not None
    [call] = [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == span.context.span_id
    ]
    assert call.name == "POST /v1/completions"


async def test_the_client_gets_the_bytes_it_would_without_token_ids(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    """The router asks for token ids and nulls them: the chunks are those of an engine
    asked without the flag (ids and times aside)."""
    one, two = engines
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        routed = await stream(router, "/v1/chat/completions", {**CHAT, **USAGE})
    assert one.bodies[0]["return_token_ids"] is True
    async with TokenEngine() as direct, running_router(direct.url) as router:
        plain = await stream(router, "/v1/chat/completions", {**CHAT, **USAGE})
    assert "return_token_ids" not in direct.bodies[0]  # one worker: nothing to migrate to

    def same(chunks: list[Any]) -> list[Any]:
        return [c if c == "[DONE]" else {**c, "id": "x", "created": 0} for c in chunks]

    assert same(routed) == same(plain)


async def test_token_ids_the_client_asked_for_are_relayed_on_both_workers(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 4))
    body = {**COMPLETION, "return_token_ids": True}
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", body)
    assert_one_stream(chunks)
    ids = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 12
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenize(COMPLETION["prompt"])
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:-1])


async def test_an_engine_stop_after_the_migration_is_the_streams_finish(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    prompt = len(tokenize(COMPLETION["prompt"]))
    for engine in engines:
        engine.eos_at = prompt + 8  # the 9th token is EOS
    one.faults.append(Fault("cut", 3))
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", {**COMPLETION, **USAGE})
    assert_one_stream(chunks)
    assert finish(chunks) == "stop"
    assert chunks[-2]["usage"]["completion_tokens"] == 9


async def test_a_chat_without_max_tokens_continues_with_the_rest_of_the_context(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 3))
    for engine in engines:
        engine.eos_at = len(render(CHAT["messages"])) + 20
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/chat/completions", body)
    assert_one_stream(chunks)
    assert finish(chunks) == "stop"
    assert one.bodies[1]["max_tokens"] is None


async def test_a_stream_migrates_again_up_to_the_limit_then_ends_with_an_error_event(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults += [Fault("cut", 2), Fault("cut", 2), Fault("cut", 2)]
    config = {"router": {"migration": {"max_per_request": 2}}}
    async with running_router(one.url, two.url, config=config, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", COMPLETION)
        resumed = await migrations(router, "cut", "resumed")
        refused = await migrations(router, "cut", "not_allowed")
    # one -> two (cut after 2 more) -> one -> cut again: a third migration is not allowed
    assert resumed == 2 and refused == 1
    assert chunks[-1]["error"]["code"] == "upstream_error"
    assert len(text(chunks).split()) == 6  # what the client got before the error event


async def test_a_second_migration_carries_what_both_workers_generated(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults += [Fault("cut", 3), Fault("error", 4)]
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", {**COMPLETION, **USAGE})
    assert_one_stream(chunks)
    expected = await uninterrupted("/v1/completions", {**COMPLETION, **USAGE})
    assert text(chunks) == text(expected)
    assert chunks[-2]["usage"]["completion_tokens"] == 12
    assert one.bodies[-1]["max_tokens"] == 12 - 3 - 4


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"n": 2},
        {"stop": ["w1"]},
    ],
    ids=["json", "tools", "n", "stop"],
)
async def test_a_request_that_cannot_continue_exactly_ends_with_an_error_event(
    engines: tuple[TokenEngine, TokenEngine], extra: dict[str, Any]
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 3))
    async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/chat/completions", {**CHAT, **extra})
        refused = await migrations(router, "cut", "not_allowed")
    assert chunks[-1]["error"]["code"] == "upstream_error"
    assert "return_token_ids" not in one.bodies[0]
    assert len(one.bodies) == 1 and refused == 1


async def test_with_migration_off_a_cut_stream_ends_with_an_error_event(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("cut", 3))
    config = {"router": {"migration": {"enabled": False}}}
    async with running_router(one.url, two.url, config=config, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", COMPLETION)
    assert chunks[-1]["error"]["code"] == "upstream_error"
    assert len(one.bodies) == 1 and "return_token_ids" not in one.bodies[0]


async def test_an_engine_that_returns_no_token_ids_has_its_streams_relayed_as_they_come() -> None:
    """SGLang, an older vLLM, the mock: the stream is relayed untouched, and a cut ends it
    with an error event as before."""
    async with StubBackend() as one, StubBackend() as two:
        for stub in (one, two):
            stub.state.chunk_interval_s = 0.001
            stub.state.cut_after_chunks = 3
        async with running_router(one.url, two.url, **ROUND_ROBIN) as router:
            resp = await router.post("/v1/completions", json=COMPLETION)
            refused = await migrations(router, "cut", "not_allowed")
    body = resp.content.split(b"\n\n")
    assert body[:3] == [b'data: {"i": %d}' % i for i in range(3)]
    assert orjson.loads(body[3][len(b"data: ") :])["error"]["code"] == "upstream_error"
    assert refused == 1


async def test_an_error_event_that_cannot_migrate_reaches_the_client_as_the_engine_sent_it(
    engines: tuple[TokenEngine, TokenEngine],
) -> None:
    one, two = engines
    one.faults.append(Fault("error", 3))
    config = {"router": {"migration": {"max_kept_bytes": 100}}}
    async with running_router(one.url, two.url, config=config, **ROUND_ROBIN) as router:
        chunks = await stream(router, "/v1/completions", COMPLETION)
    assert chunks[-2]["error"]["message"] == "EngineCore encountered an issue."
    assert chunks[-1] == "[DONE]"
    assert len(one.bodies) == 1


@pytest.mark.parametrize("fault", ["cut", "error"])
def test_a_router_process_resumes_a_stream_through_its_piece_writer(
    start_router: StartRouter, fault: str
) -> None:
    """The server's writer takes each piece straight from the upstream connection: the
    same stream on that path, and an error event stops it there."""
    faults: list[Fault] = [Fault(fault, 5)]
    bodies: list[dict[str, Any]] = []
    one, two = (
        TokenEngine(faults, bodies=bodies).start(),
        TokenEngine(faults, bodies=bodies).start(),
    )
    try:
        router = start_router(one.url, two.url, args=("--policy", "round_robin"))
        resp = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, **USAGE}, timeout=30)
        chunks = events(resp.content)
        faults.clear()
        plain = events(
            httpx.post(
                router.url + "/v1/chat/completions", json={**CHAT, **USAGE}, timeout=30
            ).content
        )
    finally:
        one.stop()
        two.stop()
    assert_one_stream(chunks)
    assert text(chunks) == text(plain)
    assert chunks[-2]["usage"] == plain[-2]["usage"]
    assert len(bodies) == 3  # the first, its continuation, the plain one


def test_the_keeper_nulls_token_ids_only_in_whole_events() -> None:
    keeper = Keeper(strip=True, chat=False, max_bytes=1000)
    event = (
        b'data: {"id":"c","choices":[{"index":0,"text":" a","prompt_token_ids":[1,2],'
        b'"token_ids":[7]}]}\n\n'
    )
    sent = keeper.feed(event[:30], first=True) + keeper.feed(event[30:])
    assert sent == event.replace(b"[1,2]", b"null").replace(b"[7]", b"null")
    t = keeper.compact()
    assert (t.prompt, list(t.generated)) == ([1, 2], [7])


def test_a_stream_without_token_ids_passes_through_whole_from_its_first_piece() -> None:
    keeper = Keeper(strip=True, chat=False, max_bytes=1000)
    first = b'data: {"i": 0}\n\ndata: {"i"'
    assert keeper.feed(first, first=True) == first
    assert keeper.passing and keeper.feed(b": 1}\n\n") == b": 1}\n\n"
