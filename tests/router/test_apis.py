"""Anthropic Messages, OpenAI Responses, model aliases and the pass-through routes, through
a router app in this loop in front of mock engines (served by uvicorn in this loop too),
driven by the official SDKs where a client would use them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from switchyard.mock.settings import MockSettings
from tests.router.inprocess import BASE_URL, InProcessRouter, running_router
from tests.router.mock_engines import mock_engines as serve_mocks
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.support import TOKENIZER_DIR, eventually_async, free_port

pytestmark = pytest.mark.timeout(60)
# Newer releases of the Anthropic SDK speak through ``httpx2``, older ones through ``httpx``.
_HTTPX2: Any = None
with contextlib.suppress(ImportError):
    import httpx2 as _HTTPX2  # type: ignore[import-not-found,no-redef]

MODEL = "m"
SYSTEM = "You answer questions about rivers, briefly and in full sentences. " * 40


@contextlib.asynccontextmanager
async def mock_engines(count: int) -> AsyncIterator[list[str]]:
    """``count`` mock vLLM engines serving ``MODEL`` on loopback; their URLs."""
    async with serve_mocks(*(MockSettings(model=MODEL, speed=100.0) for _ in range(count))) as up:
        yield [engine.url for engine in up]


@contextlib.asynccontextmanager
async def router_over_mocks(count: int = 2, **flags: Any) -> AsyncIterator[InProcessRouter]:
    async with mock_engines(count) as urls:
        async with running_router(
            *urls, policy="kv_aware", tokenizer=str(TOKENIZER_DIR), **flags
        ) as router:
            yield router


def anthropic_client(router: InProcessRouter, key: str = "unused") -> anthropic.AsyncAnthropic:
    """The SDK over the app itself (its own HTTP client library, not ``httpx``)."""
    if _HTTPX2 is None:
        return anthropic.AsyncAnthropic(
            base_url=BASE_URL, api_key=key, http_client=router.client, max_retries=0
        )
    transport = _HTTPX2.ASGITransport(app=router.app)
    client = _HTTPX2.AsyncClient(transport=transport, base_url=BASE_URL)
    return anthropic.AsyncAnthropic(
        base_url=BASE_URL, api_key=key, http_client=client, max_retries=0
    )


def openai_client(router: InProcessRouter, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=BASE_URL + "/v1", api_key=key, http_client=router.client, max_retries=0
    )


# ---- Anthropic Messages ----------------------------------------------------------------


async def test_the_anthropic_sdk_gets_a_message_from_an_engine() -> None:
    async with router_over_mocks() as router:
        client = anthropic_client(router)
        raw = await client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=5,
            system="Be brief.",
            messages=[{"role": "user", "content": "Name a river."}],
        )
        message = await raw.parse()
    assert raw.headers["x-switchyard-worker"].startswith("http://127.0.0.1:")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason == "max_tokens"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0


async def test_the_anthropic_sdk_streams_a_message_event_by_event() -> None:
    async with router_over_mocks() as router:
        client = anthropic_client(router)
        async with client.messages.stream(
            model=MODEL,
            max_tokens=6,
            messages=[{"role": "user", "content": "Name two rivers."}],
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert kinds.index("content_block_stop") < kinds.index("message_delta")
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.content[0].type == "text" and final.content[0].text


async def test_a_conversations_next_turn_goes_to_the_engine_that_holds_its_prefix() -> None:
    """Four conversations share no prefix; each one's second turn (system, question,
    answer, question) lands where its first did, and finds its first turn cached."""
    async with router_over_mocks() as router:
        client = anthropic_client(router)
        first: dict[int, tuple[str, str]] = {}
        for n in range(4):
            raw = await client.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=4,
                system=f"Conversation {n}. " + SYSTEM,
                messages=[{"role": "user", "content": f"Question {n}?"}],
            )
            answer = (await raw.parse()).content[0]
            assert answer.type == "text"
            first[n] = (raw.headers["x-switchyard-worker"], answer.text)
        assert len({worker for worker, _ in first.values()}) == 2  # spread over both
        for n, (worker, text) in first.items():
            raw = await client.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=4,
                system=f"Conversation {n}. " + SYSTEM,
                messages=[
                    {"role": "user", "content": f"Question {n}?"},
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "And another?"},
                ],
            )
            assert raw.headers["x-switchyard-worker"] == worker
            usage = (await raw.parse()).usage
            assert usage.cache_read_input_tokens is not None
            assert usage.cache_read_input_tokens > 500


async def test_count_tokens_is_relayed_and_counts_the_rendered_prompt() -> None:
    async with router_over_mocks(1, api_key="k1") as router:
        client = anthropic_client(router, key="k1")
        short = await client.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
        long = await client.messages.count_tokens(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "Hi"}]
        )
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(
                model="nope", messages=[{"role": "user", "content": "Hi"}]
            )
    assert 0 < short.input_tokens < 50 < long.input_tokens


async def test_x_api_key_is_accepted_as_well_as_a_bearer_key() -> None:
    async with router_over_mocks(1, api_key="team:k1") as router:
        ok = await router.post(
            "/v1/messages",
            headers={"x-api-key": "k1", "anthropic-version": "2023-06-01"},
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
        bearer = await router.post(
            "/v1/messages",
            headers={"authorization": "Bearer k1"},
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
        chat = await router.post(
            "/v1/chat/completions",
            headers={"x-api-key": "k1"},
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await anthropic_client(router, key="wrong").messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
            )
    assert ok.status_code == 200 and bearer.status_code == 200
    assert chat.status_code == 401  # the OpenAI routes take Bearer keys only
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid or missing API key"},
    }


async def test_the_routers_own_errors_on_messages_come_in_anthropics_shape() -> None:
    async with router_over_mocks(1) as router:
        client = anthropic_client(router)
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(
                model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
            )
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model=MODEL, max_tokens=2, messages=[])
        wrong_method = await router.get("/v1/messages")
    assert unknown.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'nope' does not exist"},
    }
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_flow_control_refuses_in_anthropics_shape_with_retry_after() -> None:
    flow = {"flow": {"tenant_requests_per_minute": {"*": 1}}}
    async with mock_engines(1) as urls:
        async with running_router(*urls, config={"router": flow}) as router:
            client = anthropic_client(router)
            await client.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
            )
            with pytest.raises(anthropic.RateLimitError) as limited:
                await client.messages.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                )
    assert limited.value.response.headers["retry-after"]
    assert isinstance(limited.value.body, dict)
    assert limited.value.body["error"]["type"] == "rate_limit_error"


async def test_no_healthy_worker_is_an_overloaded_error() -> None:
    async with running_router(f"http://127.0.0.1:{free_port()}") as router:
        answer = await router.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
    assert answer.status_code == 503 and answer.headers["retry-after"]
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "overloaded_error"


async def test_a_worker_without_the_route_is_named_in_a_clear_error() -> None:
    async with StubBackend() as stub:  # answers FastAPI's 404 to every path it lacks
        stub.state.models = [MODEL]
        async with running_router(stub.url) as router:
            answer = await router.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            )
            responses = await router.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert answer.status_code == 404
    assert answer.json() == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": f"Worker {stub.url} does not serve /v1/messages",
        },
    }
    assert answer.headers["content-length"] == str(len(answer.content))
    assert responses.status_code == 404
    assert responses.json()["error"]["code"] == "route_not_served"


async def test_the_anthropic_version_header_reaches_the_engine_and_x_api_key_does_not() -> None:
    seen: list[dict[str, str]] = []

    async def engine(request: StubRequest) -> StubReply | None:
        if request.path != "/v1/messages":
            return None
        seen.append(request.headers)
        return StubReply.json({"id": "msg_1", "type": "message", "content": []})

    async with StubBackend(engine) as stub:
        stub.state.models = [MODEL]
        async with running_router(stub.url) as router:
            answer = await router.post(
                "/v1/messages",
                headers={"anthropic-version": "2023-06-01", "x-api-key": "secret"},
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            )
    assert answer.status_code == 200
    assert seen[0]["anthropic-version"] == "2023-06-01"
    assert "x-api-key" not in seen[0]


# ---- OpenAI Responses ------------------------------------------------------------------


async def test_the_openai_sdk_creates_a_response_and_continues_it_on_its_engine() -> None:
    async with router_over_mocks() as router:
        client = openai_client(router)
        raw = await client.responses.with_raw_response.create(
            model=MODEL,
            instructions=SYSTEM,
            input="Name a river.",
            max_output_tokens=5,
        )
        first = raw.parse()
        holder = raw.headers["x-switchyard-worker"]
        # A second conversation (load-aware routing would alternate) before the next turns.
        await client.responses.create(model=MODEL, input="Another question.", max_output_tokens=2)
        turns = []
        for _ in range(3):
            again = await client.responses.with_raw_response.create(
                model=MODEL,
                instructions=SYSTEM,  # instructions do not carry over: vLLM drops the old
                previous_response_id=first.id,
                input="And a second one?",
                max_output_tokens=5,
            )
            turns.append((again.headers["x-switchyard-worker"], again.parse()))
        fetched = await client.responses.retrieve(first.id)
    assert first.object == "response" and first.model == MODEL and first.output_text
    assert first.usage is not None and first.usage.output_tokens == 5
    assert all(worker == holder for worker, _ in turns)
    assert all(r.previous_response_id == first.id for _, r in turns)
    # The engine rendered the earlier turn after the instructions: that prefix was cached.
    assert all(
        r.usage is not None and r.usage.input_tokens_details.cached_tokens > 500 for _, r in turns
    )
    assert fetched.id == first.id and fetched.output_text == first.output_text


async def test_a_streamed_response_is_remembered_from_its_first_event() -> None:
    async with router_over_mocks() as router:
        client = openai_client(router)
        stream = await client.responses.create(
            model=MODEL, input="Name three rivers.", max_output_tokens=6, stream=True
        )
        events = [event async for event in stream]
        created = events[0]
        assert created.type == "response.created"
        holder = router.app.responses.holder(created.response.id)
        follow = await client.responses.with_raw_response.create(
            model=MODEL,
            previous_response_id=created.response.id,
            input="More?",
            max_output_tokens=2,
        )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert holder is not None and follow.headers["x-switchyard-worker"] == holder


async def test_an_unknown_response_id_is_routed_normally_and_a_get_is_a_404() -> None:
    async with router_over_mocks(1) as router:
        client = openai_client(router)
        with pytest.raises(openai.NotFoundError):  # the engine's own 404: it holds no such id
            await client.responses.create(
                model=MODEL, previous_response_id="resp_unknown", input="Hi", max_output_tokens=2
            )
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve("resp_unknown")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "response_not_found"


# ---- model aliases ---------------------------------------------------------------------


async def test_an_alias_is_served_by_its_model_and_answered_in_its_name() -> None:
    async with router_over_mocks(1, model_aliases=["public-llm=m"]) as router:
        client = openai_client(router)
        done = await client.chat.completions.create(
            model="public-llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        stream = await client.chat.completions.create(
            model="public-llm",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        message = await anthropic_client(router).messages.create(
            model="public-llm", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
        )
        response = await client.responses.create(
            model="public-llm", input="Hi", max_output_tokens=2
        )
        plain = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        models = await client.models.list()
    assert done.model == "public-llm"
    assert len(chunks) > 10 and all(c.model == "public-llm" for c in chunks)
    assert message.model == "public-llm" and response.model == "public-llm"
    assert plain.model == MODEL
    cards = {m.id: m.model_dump() for m in models.data}
    assert cards["public-llm"]["root"] == MODEL and cards["public-llm"]["parent"] == MODEL
    assert MODEL in cards


def test_aliases_are_checked_and_come_from_flags_or_a_yaml_mapping() -> None:
    from switchyard.router.settings import RouterSettings

    flags = RouterSettings(model_aliases=["a=m", " b = n "])
    mapping = RouterSettings.model_validate({"model_aliases": {"a": "m"}})
    assert flags.aliases == {"a": "m", "b": "n"} and mapping.aliases == {"a": "m"}
    for bad in (["a"], ["a=a"], ["a=m", "a=n"], ["=m"]):
        with pytest.raises(ValueError):
            RouterSettings(model_aliases=bad)


# ---- pass-through ----------------------------------------------------------------------


async def test_tokenize_and_detokenize_reach_an_engine_of_their_model() -> None:
    async with router_over_mocks(1) as router:
        tokens = await router.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
        unnamed = await router.post("/tokenize", json={"prompt": "Hello there"})
        text = await router.post(
            "/detokenize", json={"model": MODEL, "tokens": tokens.json()["tokens"]}
        )
        unknown = await router.post("/tokenize", json={"model": "nope", "prompt": "Hi"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    assert unnamed.json()["tokens"] == tokens.json()["tokens"]  # the fleet's one model
    assert text.json()["prompt"] == "Hello there"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


async def test_rerank_and_score_are_relayed_as_they_are() -> None:
    seen: list[tuple[str, Any]] = []

    async def pool(request: StubRequest) -> StubReply | None:
        if request.path in ("/v1/rerank", "/v1/score"):
            seen.append((request.path, request.json()))
            return StubReply.json({"id": "x", "model": MODEL, "results": [], "data": []})
        return None

    async with StubBackend(pool) as stub:
        stub.state.models = [MODEL]
        async with running_router(stub.url) as router:
            rerank_body = {"model": MODEL, "query": "q", "documents": ["a", "b"]}
            rerank = await router.post("/v1/rerank", json=rerank_body)
            score = await router.post(
                "/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"}
            )
    assert rerank.status_code == 200 and score.status_code == 200
    assert seen == [
        ("/v1/rerank", rerank_body),
        ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ]
    assert orjson.loads(rerank.content)["model"] == MODEL


async def test_models_lists_only_aliases_whose_model_is_served() -> None:
    async with router_over_mocks(1, model_aliases=["x=m", "y=absent"]) as router:
        listed = await router.get("/v1/models")
    assert [card["id"] for card in listed.json()["data"]] == [MODEL, "x"]


# ---- the answer filter and usage, piece by piece ----------------------------------------


async def test_a_served_name_cut_between_two_pieces_is_still_renamed() -> None:
    from switchyard.router.apis import AnswerFilter, renaming

    sent: list[bytes] = []
    written: list[bytes] = []

    class Client:
        async def __call__(self, message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        def stream_writer(self) -> Any:
            return lambda piece: written.append(piece)

    answer = AnswerFilter(Client(), "/v1/chat/completions", renaming("served-model", "pub"), None)
    head = [(b"content-type", b"text/event-stream")]
    await answer({"type": "http.response.start", "status": 200, "headers": head})
    await answer({"type": "http.response.body", "body": b'data: {"model":"ser', "more_body": True})
    write = answer.stream_writer()
    assert write is not None
    write(b'ved-model","x":1}\n\ndata: {"model":"served-model"}\n\ndata: {"mod')
    write(b'el":"served-model"}\n\n')
    await answer({"type": "http.response.body", "body": b""})
    stream = b"".join(sent[:1] + written + sent[1:])
    assert stream == (
        b'data: {"model":"pub","x":1}\n\ndata: {"model":"pub"}\n\ndata: {"model":"pub"}\n\n'
    )


async def test_a_response_id_reaches_the_routers_other_processes(tmp_path: Path) -> None:
    from switchyard.balancer.siblings import SiblingBus
    from switchyard.router.apis import ResponseHolders

    buses = [SiblingBus(tmp_path, rescan_s=0.05) for _ in range(2)]
    holders = [ResponseHolders(limit=2, siblings=bus) for bus in buses]
    for bus in buses:
        await bus.start()
    try:
        await eventually_async(lambda: all(bus.peers == 1 for bus in buses))
        holders[0].remember("resp_1", "http://a")
        assert await eventually_async(lambda: holders[1].holder("resp_1"), 3, 0.02)
        for n in (2, 3):
            holders[1].remember(f"resp_{n}", "http://b")
        assert holders[1].holder("resp_1") is None  # the oldest of three, past the limit
        assert holders[1].holder("resp_3") == "http://b"
    finally:
        for bus in buses:
            await bus.stop()
