"""P/D through the router with the official openai client: vLLM and SGLang flows, E/P/D."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.pd.support_pd import LONG_PROMPT, MODEL, metric, mock, router, sglang_prefill, spec
from tests.support import Server, eventually

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


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, ...]]:
    prefill = mock("--role", "prefill", "--engine-id", "prefill-0")
    decode = mock("--role", "decode")
    front = router(
        tmp_path_factory.mktemp("vllm"),
        "vllm",
        prefill=[spec(prefill.url)],
        decode=[spec(decode.url)],
    )
    try:
        yield front, prefill, decode
    finally:
        for s in (front, prefill, decode):
            s.stop()


@pytest.fixture(scope="module")
def sglang_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, ...]]:
    prefill, boot = sglang_prefill()
    decode = mock("--flavor", "sglang", "--role", "decode", "--pd-wait-timeout-s", "5")
    front = router(
        tmp_path_factory.mktemp("sglang"),
        "sglang",
        prefill=[spec(prefill.url, bootstrap=boot)],
        decode=[spec(decode.url)],
    )
    try:
        yield front, prefill, decode
    finally:
        for s in (front, prefill, decode):
            s.stop()


def settle(url: str, name: str, value: float) -> float:
    """The metric once it reached ``value`` (the prefill frees blocks just after the pull)."""
    eventually(lambda: metric(url, name) == value, 2, 0.02, f"{name} settles at {value}")
    return metric(url, name)


def test_a_router_with_only_a_prefill_and_a_decode_worker_is_ready(vllm_stack) -> None:
    front = vllm_stack[0]

    def ready() -> httpx.Response | None:
        resp = httpx.get(front.url + "/ready", timeout=5)
        return resp if resp.status_code == 200 else None

    resp = eventually(ready, 30, 0.2)
    assert resp.json() == {"status": "ready", "routable_workers": 2}


def test_vllm_completion_is_prefilled_remotely_and_the_prefill_frees_its_blocks(
    vllm_stack,
) -> None:
    front, prefill, decode = vllm_stack
    idle = metric(prefill.url, "vllm:kv_cache_usage_perc")
    remote = metric(decode.url, "mockengine_remote_prefills_total")
    pulls = metric(prefill.url, "mockengine_kv_pulls_served_total")
    raw = client(front).completions.with_raw_response.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=6
    )
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert int(raw.headers["x-mock-remote-prefill-tokens"]) == out.usage.prompt_tokens
    assert metric(decode.url, "mockengine_remote_prefills_total") == remote + 1
    assert metric(prefill.url, "mockengine_kv_pulls_served_total") == pulls + 1
    assert settle(prefill.url, "vllm:kv_cache_usage_perc", idle) == idle


def test_vllm_chat_stream_is_relayed_from_the_decode_worker(vllm_stack) -> None:
    front, prefill, decode = vllm_stack
    remote = metric(decode.url, "mockengine_remote_prefills_total")
    stream = client(front).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert metric(decode.url, "mockengine_remote_prefills_total") == remote + 1


def test_router_reports_the_ttft_split_and_the_disaggregated_path(vllm_stack) -> None:
    front, _, _ = vllm_stack
    list(
        client(front).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, stream=True)
    )
    name = "switchyard_router_pd_ttft_phase_seconds_count"
    assert metric(front.url, "switchyard_router_pd_requests_total", path="disaggregated") >= 1
    for phase in ("prefill", "transfer", "decode_first_token"):
        assert metric(front.url, name, protocol="vllm", phase=phase) >= 1
    assert metric(front.url, "switchyard_router_pd_pool_workers", pool="prefill") == 1


def test_sglang_completion_runs_both_legs_with_one_bootstrap_room(sglang_stack) -> None:
    front, prefill, decode = sglang_stack
    idle = metric(prefill.url, "sglang:token_usage")
    pulls = metric(prefill.url, "mockengine_kv_pulls_served_total")
    raw = client(front).completions.with_raw_response.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=7
    )
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert int(raw.headers["x-mock-remote-prefill-tokens"]) == out.usage.prompt_tokens
    assert metric(prefill.url, "mockengine_kv_pulls_served_total") == pulls + 1
    assert settle(prefill.url, "sglang:token_usage", idle) == idle


def test_sglang_chat_stream_is_relayed_from_the_decode_worker(sglang_stack) -> None:
    front, _, decode = sglang_stack
    remote = metric(decode.url, "mockengine_remote_prefills_total")
    stream = client(front).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4, stream=True
    )
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 4
    assert metric(decode.url, "mockengine_remote_prefills_total") == remote + 1


def test_epd_encodes_the_image_once_and_prefill_and_decode_skip_the_vision_encoder(
    tmp_path: Path,
) -> None:
    slow_vision = ("--encode-us-per-image", "40000000")  # 2 s at --speed 20
    encoder = mock("--role", "encode")
    prefill = mock("--role", "prefill", *slow_vision)
    decode = mock("--role", "decode", *slow_vision)
    front = router(
        tmp_path,
        "vllm",
        prefill=[spec(prefill.url)],
        decode=[spec(decode.url)],
        encode=[spec(encoder.url)],
    )
    try:
        started = time.monotonic()
        out = client(front).chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=3)
        elapsed = time.monotonic() - started
        encodes = metric(front.url, "switchyard_router_pd_ttft_phase_seconds_count", phase="encode")
        remote = metric(decode.url, "mockengine_remote_prefills_total")
    finally:
        for s in (front, encoder, prefill, decode):
            s.stop()
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert encodes == 1
    assert remote == 1
    assert elapsed < 1.5
