"""Conditional disaggregation: short uncached prompts skip the prefill pool."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.pd.support_pd import LONG_PROMPT, MODEL, metric, mock, router, spec
from tests.pd.support_pd import process_vllm_pair as vllm_pair
from tests.support import TOKENIZER_DIR

pytestmark = pytest.mark.timeout(60)

OTHER_PROMPT = "an unrelated opening that shares nothing with the other prompt " * 12


def test_short_prompts_go_straight_to_decode_and_long_ones_through_prefill(
    tmp_path: Path,
) -> None:
    front, prefill, decode = vllm_pair(tmp_path, args=("--pd-min-prefill-tokens", "64"))
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=15)
    try:
        short = client.completions.with_raw_response.create(
            model=MODEL, prompt="short question", max_tokens=2
        )
        long = client.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2
        )
        direct = metric(front.url, "switchyard_router_pd_requests_total", path="direct")
        pulls = metric(prefill.url, "mockengine_kv_pulls_served_total")
    finally:
        for s in (front, prefill, decode):
            s.stop()
    assert "x-mock-remote-prefill-tokens" not in short.headers
    assert "x-mock-remote-prefill-tokens" in long.headers
    assert direct == 1
    assert pulls == 1


def test_with_a_kv_store_a_follow_up_turn_skips_the_prefill_pool(tmp_path: Path) -> None:
    front, prefill, decode = vllm_pair(
        tmp_path, args=("--pd-min-prefill-tokens", "64", "--tokenizer", str(TOKENIZER_DIR))
    )
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=15)
    try:
        first = client.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2
        )
        again = client.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT + " and one more thing", max_tokens=2
        )
        fresh = client.completions.with_raw_response.create(
            model=MODEL, prompt=OTHER_PROMPT, max_tokens=2
        )
        direct = metric(front.url, "switchyard_router_pd_requests_total", path="direct")
        informed = metric(front.url, "switchyard_router_pd_decisions_total", source="kvstore")
    finally:
        for s in (front, prefill, decode):
            s.stop()
    assert informed == 3
    assert "x-mock-remote-prefill-tokens" in first.headers
    assert "x-mock-remote-prefill-tokens" not in again.headers
    assert "x-mock-remote-prefill-tokens" in fresh.headers
    assert direct == 1


def test_with_a_kv_store_the_prefill_pool_keeps_a_prefix_on_one_worker(tmp_path: Path) -> None:
    prefills = [mock("--role", "prefill"), mock("--role", "prefill")]
    decode = mock("--role", "decode")
    front = router(
        tmp_path,
        "vllm",
        prefill=[spec(p.url) for p in prefills],
        decode=[spec(decode.url)],
        args=("--tokenizer", str(TOKENIZER_DIR)),
    )
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=15)

    def served_by(prompt: str) -> int:
        before = [metric(p.url, "mockengine_kv_pulls_served_total") for p in prefills]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        after = [metric(p.url, "mockengine_kv_pulls_served_total") for p in prefills]
        return [b - a for a, b in zip(before, after, strict=True)].index(1)

    try:
        a, b = served_by(LONG_PROMPT), served_by(OTHER_PROMPT)
        a2, b2 = served_by(LONG_PROMPT + " again"), served_by(OTHER_PROMPT + " again")
    finally:
        for s in (front, *prefills, decode):
            s.stop()
    assert (a2, b2) == (a, b)
