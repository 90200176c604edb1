"""Conditional disaggregation: short uncached prompts skip the prefill pool."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.pd.support_pd import LONG_PROMPT, MODEL, metric, mock, router, spec

pytestmark = pytest.mark.timeout(60)


def test_short_prompts_go_straight_to_decode_and_long_ones_through_prefill(
    tmp_path: Path,
) -> None:
    prefill = mock("--role", "prefill")
    decode = mock("--role", "decode")
    front = router(
        tmp_path,
        "vllm",
        prefill=[spec(prefill.url)],
        decode=[spec(decode.url)],
        args=("--pd-min-prefill-tokens", "64"),
    )
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
