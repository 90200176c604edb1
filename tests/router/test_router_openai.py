"""The official openai client, sync and async, through the router to mock vLLM engines."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.router.conftest import StartRouter
from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(90)

MODEL = "mock-llama"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Server]]:
    servers = []
    try:
        for _ in range(2):
            port = free_port()
            argv = ["mock", "--port", str(port), "--model", MODEL, "--speed", "100"]
            servers.append(Server(argv, port).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def client(engines: list[Server], start_router: StartRouter) -> openai.OpenAI:
    router = start_router(*(e.url for e in engines))
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(engines: list[Server], start_router: StartRouter) -> openai.AsyncOpenAI:
    router = start_router(*(e.url for e in engines))
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_union_of_workers(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_non_stream(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) == 6
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_non_stream(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_chat_stream_with_usage_in_the_final_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert final.usage.completion_tokens == 3 and final.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_embeddings_are_routed(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=MODEL, input="a sentence to embed")
    assert len(out.data) == 1 and len(out.data[0].embedding) > 0


def test_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_async_chat_stream(async_client: openai.AsyncOpenAI) -> None:
    stream = await async_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        max_tokens=5,
        stream=True,
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 5


async def test_async_completion_non_stream(async_client: openai.AsyncOpenAI) -> None:
    out = await async_client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
