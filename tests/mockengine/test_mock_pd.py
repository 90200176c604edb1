"""P/D disaggregation end to end: vLLM's KV-connector flow, SGLang's bootstrap flow, E/P/D."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from switchyard.mock.epd import mm_hash
from tests.support import Server, eventually, free_port, metric

pytestmark = pytest.mark.timeout(60)

PROMPT = "disaggregated prefill " * 30


def metric_of(srv: Server, name: str) -> float:
    return metric(httpx.get(srv.url + "/metrics").text, name)


def start(*args: str) -> Server:
    port = free_port()
    return Server(["mock", "--port", str(port), "--speed", "20", *args], port).start()


@pytest.fixture(scope="module")
def vllm_pair() -> Iterator[tuple[Server, Server]]:
    prefill = start("--role", "prefill", "--engine-id", "prefill-0")
    decode = start("--role", "decode")
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def prefill_leg(prefill: Server, rid: str) -> dict[str, Any]:
    """What vLLM's toy proxy sends first: max_tokens=1 and do_remote_decode."""
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    r = httpx.post(prefill.url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200
    return r.json()


def test_vllm_prefill_answers_one_token_with_kv_transfer_params(vllm_pair) -> None:
    prefill, _ = vllm_pair
    out = prefill_leg(prefill, "pd-shape")
    params = out["kv_transfer_params"]
    assert out["usage"]["completion_tokens"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == int(prefill.url.rsplit(":", 1)[1])
    assert len(params["remote_block_ids"]) >= out["usage"]["prompt_tokens"] // 16
    assert params["remote_request_id"] == "pd-shape"


def test_vllm_flow_decodes_after_pulling_and_prefill_frees_held_blocks(vllm_pair) -> None:
    prefill, decode = vllm_pair
    pulls_before = metric_of(prefill, "mockengine_kv_pulls_served_total")
    usage_before = metric_of(prefill, "vllm:kv_cache_usage_perc")
    params = prefill_leg(prefill, "pd-flow")["kv_transfer_params"]
    assert metric_of(prefill, "vllm:kv_cache_usage_perc") > usage_before
    r = httpx.post(
        decode.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params},
        headers={"X-Request-Id": "pd-flow"},
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 8
    assert int(r.headers["x-mock-remote-prefill-tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert metric_of(decode, "mockengine_remote_prefills_total") >= 1
    assert metric_of(prefill, "mockengine_kv_pulls_served_total") == pulls_before + 1
    # The prefill frees the held blocks just after the pull, not before the decode answers.
    eventually(lambda: metric_of(prefill, "vllm:kv_cache_usage_perc") == usage_before, 5)


def test_vllm_decode_recomputes_when_the_held_kv_is_gone(vllm_pair) -> None:
    prefill, decode = vllm_pair
    params = prefill_leg(prefill, "pd-twice")["kv_transfer_params"]
    body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    first = httpx.post(decode.url + "/v1/completions", json=body)
    second = httpx.post(decode.url + "/v1/completions", json=body)
    assert first.status_code == second.status_code == 200
    assert "x-mock-remote-prefill-tokens" in first.headers
    assert "x-mock-remote-prefill-tokens" not in second.headers
    assert metric_of(decode, "mockengine_kv_pull_failures_total") >= 1


def test_vllm_prefill_frees_unpulled_blocks_after_the_hold_expires() -> None:
    # 100 s of model time at speed 20: 5 s of wall time to see the hold (0.1 s was
    # often over before the scrape on a loaded machine).
    prefill = start("--role", "prefill", "--held-kv-timeout-s", "100")
    try:
        idle = metric_of(prefill, "vllm:kv_cache_usage_perc")
        prefill_leg(prefill, "never-pulled")
        assert metric_of(prefill, "vllm:kv_cache_usage_perc") > idle
        eventually(lambda: metric_of(prefill, "vllm:kv_cache_usage_perc") <= idle, 20, 0.02)
        assert metric_of(prefill, "vllm:kv_cache_usage_perc") == idle
    finally:
        prefill.stop()


@pytest.fixture(scope="module")
def sglang_pair() -> Iterator[tuple[Server, Server, int]]:
    boot = free_port()
    prefill = start("--flavor", "sglang", "--role", "prefill", "--bootstrap-port", str(boot))
    decode = start("--flavor", "sglang", "--role", "decode", "--pd-wait-timeout-s", "0.5")
    try:
        yield prefill, decode, boot
    finally:
        prefill.stop()
        decode.stop()


def test_sglang_flow_decode_waits_for_the_prefill_of_its_room(sglang_pair) -> None:
    prefill, decode, boot = sglang_pair
    idle = metric_of(prefill, "sglang:token_usage")
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 4242}
    body = {"prompt": PROMPT, "max_tokens": 8, **bootstrap}
    result: dict[str, httpx.Response] = {}

    def decode_leg() -> None:
        result["decode"] = httpx.post(decode.url + "/v1/completions", json=body, timeout=10)

    waiter = threading.Thread(target=decode_leg)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    pre = httpx.post(prefill.url + "/v1/completions", json=body)
    waiter.join(10)
    r = result["decode"]
    assert pre.status_code == 200 and pre.json()["usage"]["completion_tokens"] == 1
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert int(r.headers["x-mock-remote-prefill-tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert metric_of(prefill, "mockengine_kv_pulls_served_total") == 1
    assert metric_of(prefill, "sglang:token_usage") == idle


def test_sglang_decode_without_prefill_times_out_with_a_clear_error(sglang_pair) -> None:
    _, decode, boot = sglang_pair
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": boot,
        "bootstrap_room": 999,
    }
    started = time.monotonic()
    r = httpx.post(decode.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 504
    assert "bootstrap room 999" in r.json()["error"]["message"]
    assert time.monotonic() - started < 3


IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
            {"type": "text", "text": "what is this?"},
        ],
    }
]


def test_encode_role_returns_an_embedding_handle_per_image() -> None:
    encoder = start("--role", "encode")
    try:
        r = httpx.post(encoder.url + "/v1/encode", json={"messages": IMAGE_CHAT})
        chat = httpx.post(
            encoder.url + "/v1/chat/completions", json={"messages": IMAGE_CHAT, "max_tokens": 1}
        )
    finally:
        encoder.stop()
    params = r.json()["ec_transfer_params"]
    assert r.json()["num_images"] == 1
    [(handle, entry)] = params.items()
    assert entry["num_encoder_tokens"] > 0
    assert chat.json()["ec_transfer_params"] == params


def test_prefill_leg_with_an_encoder_handle_skips_the_vision_encoder() -> None:
    args = ("--speed", "1", "--encode-us-per-image", "300000")
    port = free_port()

    def chat_seconds(srv: Server, ec_params: dict[str, Any] | None) -> float:
        body: dict[str, Any] = {"messages": IMAGE_CHAT, "max_tokens": 1}
        if ec_params is not None:
            body["ec_transfer_params"] = ec_params
        started = time.monotonic()
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200
        return time.monotonic() - started

    with Server(["mock", "--port", str(port), *args], port) as prefill:
        local = chat_seconds(prefill, None)
        other_image = chat_seconds(prefill, {"0" * 32: {"num_encoder_tokens": 256}})
        handle = mm_hash("https://example.invalid/cat.png")
        remote = chat_seconds(prefill, {handle: {"num_encoder_tokens": 256}})
    assert local >= 0.3
    assert other_image >= 0.3
    assert remote < local - 0.2
