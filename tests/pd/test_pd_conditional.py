"""Conditional disaggregation: short uncached prompts skip the prefill pool."""

from __future__ import annotations

import pytest

from tests.pd.support_pd import LONG_PROMPT, MODEL, pd_router, running_mock, vllm_pair
from tests.support import TOKENIZER_DIR

pytestmark = pytest.mark.timeout(60)

OTHER_PROMPT = "an unrelated opening that shares nothing with the other prompt " * 12


async def test_short_prompts_go_straight_to_decode_and_long_ones_through_prefill() -> None:
    async with vllm_pair(pd={"min_prefill_tokens": 64}) as (front, prefill, decode):
        short = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt="short question", max_tokens=2
        )
        long = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2
        )
        direct = await front.metric("switchyard_router_pd_requests_total", path="direct")
        pulls = await prefill.metric("mockengine_kv_pulls_served_total")
    assert "x-mock-remote-prefill-tokens" not in short.headers
    assert "x-mock-remote-prefill-tokens" in long.headers
    assert direct == 1
    assert pulls == 1
    assert (prefill.generations, decode.generations) == (1, 2)


async def test_with_a_kv_store_a_follow_up_turn_skips_the_prefill_pool() -> None:
    async with vllm_pair(pd={"min_prefill_tokens": 64}, tokenizer=str(TOKENIZER_DIR)) as (
        front,
        prefill,
        _,
    ):
        first = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2
        )
        await front.placed()
        again = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT + " and one more thing", max_tokens=2
        )
        await front.placed()
        fresh = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt=OTHER_PROMPT, max_tokens=2
        )
        direct = await front.metric("switchyard_router_pd_requests_total", path="direct")
        informed = await front.metric("switchyard_router_pd_decisions_total", source="kvstore")
    assert informed == 3
    assert "x-mock-remote-prefill-tokens" in first.headers
    assert "x-mock-remote-prefill-tokens" not in again.headers
    assert "x-mock-remote-prefill-tokens" in fresh.headers
    assert direct == 1
    assert prefill.generations == 2


async def test_with_a_kv_store_the_prefill_pool_keeps_a_prefix_on_one_worker() -> None:
    async with (
        running_mock(role="prefill") as p0,
        running_mock(role="prefill") as p1,
        running_mock(role="decode") as decode,
        pd_router("vllm", prefill=[p0, p1], decode=[decode], tokenizer=str(TOKENIZER_DIR)) as front,
    ):
        prefills = [p0, p1]

        async def served_by(prompt: str) -> int:
            before = [await p.metric("mockengine_kv_pulls_served_total") for p in prefills]
            await front.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            await front.placed()
            after = [await p.metric("mockengine_kv_pulls_served_total") for p in prefills]
            return [b - a for a, b in zip(before, after, strict=True)].index(1)

        a, b = await served_by(LONG_PROMPT), await served_by(OTHER_PROMPT)
        a2, b2 = await served_by(LONG_PROMPT + " again"), await served_by(OTHER_PROMPT + " again")
    assert (a2, b2) == (a, b)
