"""The OpenAI surface through the router, answered by real vLLM engines."""

from __future__ import annotations

import asyncio

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.real.conftest import MAX_MODEL_LEN, MODEL
from tests.support import Server

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name three rivers of Europe and one fact about each."}
]


def client(router: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", timeout=120)


def async_client(router: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", timeout=120)


def test_sync_sdk_chat_returns_the_engines_completion(router: Server) -> None:
    done = client(router).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert done.model == MODEL and done.choices[0].finish_reason in ("length", "stop")
    assert done.usage is not None and done.usage.completion_tokens == 5


def test_sync_sdk_stream_delivers_tokens_and_usage(router: Server) -> None:
    stream = client(router).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and usage.completion_tokens == 6


def test_async_sdk_chat_returns_the_engines_completion(router: Server) -> None:
    async def ask() -> openai.types.chat.ChatCompletion:
        async with async_client(router) as c:
            return await c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)

    done = asyncio.run(ask())
    assert done.usage is not None and done.usage.completion_tokens == 4


def test_async_sdk_stream_ends_with_a_finish_reason(router: Server) -> None:
    async def ask() -> list[str | None]:
        async with async_client(router) as c:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                max_tokens=4,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [ch.choices[0].finish_reason async for ch in stream if ch.choices]

    reasons = asyncio.run(ask())
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_a_repeated_chat_reports_the_engines_cached_tokens(router: Server) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Summarise the history of the printing press. " * 30}
    ]
    c = client(router)
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    prompt = again.usage.prompt_tokens
    # Every whole 32-token block except one holding the last prompt token is reused.
    assert details.cached_tokens == (prompt - 1) // 32 * 32


def test_a_prompt_over_max_model_len_gets_vllms_error_in_openai_shape(router: Server) -> None:
    messages = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 100)}]
    resp = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert str(MAX_MODEL_LEN) in error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
