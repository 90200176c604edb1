"""P/D through the router with the official openai client: vLLM and SGLang flows, E/P/D."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.pd.support_pd import (
    LONG_PROMPT,
    MODEL,
    Mock,
    PDRouter,
    pd_router,
    running_mock,
    vllm_pair,
)
from tests.support import eventually_async

pytestmark = pytest.mark.timeout(60)

IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
            {"type": "text", "text": "what is in this picture? " * 10},
        ],
    }
]

Stack = tuple[PDRouter, Mock, Mock]


@pytest.fixture
async def vllm_stack() -> AsyncIterator[Stack]:
    async with vllm_pair(prefill={"engine_id": "prefill-0"}) as stack:
        yield stack


@pytest.fixture
async def sglang_stack() -> AsyncIterator[Stack]:
    async with (
        running_mock(flavor="sglang", role="prefill") as prefill,
        running_mock(flavor="sglang", role="decode", pd_wait_timeout_s=5) as decode,
        pd_router("sglang", prefill=[prefill], decode=[decode]) as front,
    ):
        yield front, prefill, decode


async def settle(engine: Mock, name: str, value: float) -> float:
    """The metric once it reached ``value`` (the prefill frees blocks just after the pull)."""

    async def settled() -> bool:
        return await engine.metric(name) == value

    await eventually_async(settled, 2, 0.02, f"{name} settles at {value}")
    return await engine.metric(name)


async def test_a_router_with_only_a_prefill_and_a_decode_worker_is_ready(
    vllm_stack: Stack,
) -> None:
    front = vllm_stack[0]

    async def ready() -> bool:
        return (await front.router.get("/ready")).status_code == 200

    await eventually_async(ready, 30, 0.05)
    resp = await front.router.get("/ready")
    assert resp.json() == {"status": "ready", "routable_workers": 2}


async def test_vllm_completion_is_prefilled_remotely_and_the_prefill_frees_its_blocks(
    vllm_stack: Stack,
) -> None:
    front, prefill, decode = vllm_stack
    idle = await prefill.metric("vllm:kv_cache_usage_perc")
    raw = await front.openai.completions.with_raw_response.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=6
    )
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert int(raw.headers["x-mock-remote-prefill-tokens"]) == out.usage.prompt_tokens
    assert await decode.metric("mockengine_remote_prefills_total") == 1
    assert await prefill.metric("mockengine_kv_pulls_served_total") == 1
    assert await settle(prefill, "vllm:kv_cache_usage_perc", idle) == idle


async def test_vllm_chat_stream_is_relayed_from_the_decode_worker(vllm_stack: Stack) -> None:
    front, _, decode = vllm_stack
    stream = await front.openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert await decode.metric("mockengine_remote_prefills_total") == 1


async def test_router_reports_the_ttft_split_and_the_disaggregated_path(
    vllm_stack: Stack,
) -> None:
    front, _, _ = vllm_stack
    stream = await front.openai.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=3, stream=True
    )
    [c async for c in stream]
    name = "switchyard_router_pd_ttft_phase_seconds_count"
    assert await front.metric("switchyard_router_pd_requests_total", path="disaggregated") == 1
    for phase in ("prefill", "transfer", "decode_first_token"):
        assert await front.metric(name, protocol="vllm", phase=phase) == 1
    assert await front.metric("switchyard_router_pd_pool_workers", pool="prefill") == 1


async def test_sglang_completion_runs_both_legs_with_one_bootstrap_room(
    sglang_stack: Stack,
) -> None:
    front, prefill, decode = sglang_stack
    idle = await prefill.metric("sglang:token_usage")
    raw = await front.openai.completions.with_raw_response.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=7
    )
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert int(raw.headers["x-mock-remote-prefill-tokens"]) == out.usage.prompt_tokens
    assert await prefill.metric("mockengine_kv_pulls_served_total") == 1
    assert (prefill.generations, decode.generations) == (1, 1)
    assert await settle(prefill, "sglang:token_usage", idle) == idle


async def test_sglang_chat_stream_is_relayed_from_the_decode_worker(sglang_stack: Stack) -> None:
    front, _, decode = sglang_stack
    stream = await front.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 4
    assert await decode.metric("mockengine_remote_prefills_total") == 1


async def test_epd_encodes_the_image_once_and_prefill_and_decode_skip_the_vision_encoder() -> None:
    async with (
        running_mock(role="encode") as encoder,
        running_mock(role="prefill") as prefill,
        running_mock(role="decode") as decode,
        pd_router("vllm", prefill=[prefill], decode=[decode], encode=[encoder]) as front,
    ):
        out = await front.openai.chat.completions.create(
            model=MODEL, messages=IMAGE_CHAT, max_tokens=3
        )
        encodes = await front.metric(
            "switchyard_router_pd_ttft_phase_seconds_count", phase="encode"
        )
        remote = await decode.metric("mockengine_remote_prefills_total")
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert encodes == 1
    assert remote == 1
    assert (encoder.images_encoded, prefill.images_encoded, decode.images_encoded) == (1, 0, 0)
