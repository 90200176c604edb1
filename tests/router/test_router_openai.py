"""The official openai client through the router (in-process) to mock vLLM engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from tests.router.inprocess import BASE_URL, running_router
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
async def client(engines: list[Server]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with running_router(*(e.url for e in engines)) as router:
        yield openai.AsyncOpenAI(
            base_url=BASE_URL + "/v1", api_key="unused", max_retries=0, http_client=router.client
        )


async def test_models_lists_the_union_of_workers(client: openai.AsyncOpenAI) -> None:
    assert [m.id async for m in await client.models.list()] == [MODEL]


async def test_completion_non_stream(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5


async def test_completion_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True
    )
    chunks = [c async for c in stream]
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) == 6
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_non_stream(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 4


async def test_chat_stream_with_usage_in_the_final_chunk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert final.usage.completion_tokens == 3 and final.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


async def test_embeddings_are_routed(client: openai.AsyncOpenAI) -> None:
    out = await client.embeddings.create(model=MODEL, input="a sentence to embed")
    assert len(out.data) == 1 and len(out.data[0].embedding) > 0


async def test_unknown_model_raises_not_found(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_chat_stream_of_content_parts(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        max_tokens=5,
        stream=True,
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 5


async def test_short_completion_non_stream(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
