"""Every disaggregated request ends: dead prefill or decode, transfer timeout; all bounded."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.pd.support_pd import (
    LONG_PROMPT,
    MODEL,
    metric,
    mock,
    router,
    sglang_prefill,
    spec,
)
from tests.pd.support_pd import (
    process_vllm_pair as vllm_pair,
)
from tests.support import Server, eventually, free_port

pytestmark = pytest.mark.timeout(60)


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=15)


def dead() -> str:
    return f"http://127.0.0.1:{free_port()}"


def stop(*servers: Server) -> None:
    for s in servers:
        s.stop()


def test_vllm_dead_prefill_falls_back_to_the_whole_request_on_decode(tmp_path: Path) -> None:
    decode = mock("--role", "decode")
    front = router(tmp_path, "vllm", prefill=[spec(dead())], decode=[spec(decode.url)])
    try:
        started = time.monotonic()
        raw = client(front).completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=4
        )
        elapsed = time.monotonic() - started
        fallbacks = metric(front.url, "switchyard_router_pd_fallbacks_total")
    finally:
        stop(front, decode)
    assert raw.parse().usage.completion_tokens == 4
    assert "x-mock-remote-prefill-tokens" not in raw.headers
    assert fallbacks == 1
    assert elapsed < 3


def test_vllm_prefill_failure_is_retried_on_another_prefill_worker(tmp_path: Path) -> None:
    failing = mock("--role", "prefill", "--fault-error-rate", "1")
    prefill = mock("--role", "prefill")
    decode = mock("--role", "decode")
    front = router(
        tmp_path,
        "vllm",
        prefill=[spec(failing.url), spec(prefill.url)],
        decode=[spec(decode.url)],
        pd={"prefill_policy": "round_robin"},
    )
    try:
        outs = [
            client(front).completions.with_raw_response.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=2
            )
            for _ in range(2)
        ]
        failures = metric(front.url, "switchyard_router_pd_leg_failures_total", leg="prefill")
    finally:
        stop(front, failing, prefill, decode)
    assert all("x-mock-remote-prefill-tokens" in o.headers for o in outs)
    assert failures >= 1


def test_sglang_failed_prefill_aborts_the_waiting_decode_leg_with_a_clear_error(
    tmp_path: Path,
) -> None:
    prefill, boot = sglang_prefill("--fault-error-rate", "1")
    decode = mock("--flavor", "sglang", "--role", "decode", "--pd-wait-timeout-s", "2")
    front = router(
        tmp_path,
        "sglang",
        prefill=[spec(prefill.url, bootstrap=boot)],
        decode=[spec(decode.url)],
        pd={"prefill_attempts": 1},
    )
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client(front).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
        elapsed = time.monotonic() - started
        aborted = metric(
            front.url, "switchyard_router_pd_aborts_total", leg="decode", reason="status_500"
        )
    finally:
        stop(front, prefill, decode)
    assert err.value.status_code == 502
    assert err.value.body["code"] == "pd_prefill_failed"
    assert aborted == 1
    assert elapsed < 1.5


def test_sglang_dead_prefill_ends_in_a_clear_error_without_waiting(tmp_path: Path) -> None:
    decode = mock("--flavor", "sglang", "--role", "decode", "--pd-wait-timeout-s", "30")
    front = router(
        tmp_path, "sglang", prefill=[spec(dead(), bootstrap=1)], decode=[spec(decode.url)]
    )
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client(front).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
        elapsed = time.monotonic() - started
    finally:
        stop(front, decode)
    assert err.value.status_code in (502, 503)
    assert err.value.body["code"] in ("pd_prefill_failed", "pd_no_prefill")
    assert elapsed < 3


def test_dead_decode_is_retried_on_another_decode_before_the_first_byte(tmp_path: Path) -> None:
    prefill = mock("--role", "prefill")
    decode = mock("--role", "decode")
    front = router(
        tmp_path,
        "vllm",
        prefill=[spec(prefill.url)],
        decode=[spec(dead()), spec(decode.url)],
        pd={"decode_policy": "round_robin"},
    )
    try:
        started = time.monotonic()
        streams = [
            list(
                client(front).completions.create(
                    model=MODEL, prompt=LONG_PROMPT, max_tokens=3, stream=True
                )
            )
            for _ in range(2)
        ]
        elapsed = time.monotonic() - started
        remote = metric(decode.url, "mockengine_remote_prefills_total")
    finally:
        stop(front, prefill, decode)
    assert all(sum(1 for c in s if c.choices and c.choices[0].text) == 3 for s in streams)
    assert remote == 2
    assert elapsed < 5


def test_sglang_transfer_timeout_ends_in_a_504_and_aborts_both_legs(tmp_path: Path) -> None:
    prefill, boot = sglang_prefill("--fault-hang-rate", "1")
    # The decode's own bootstrap wait (2 s) outlasts the router's transfer deadline (1 s).
    decode = mock("--flavor", "sglang", "--role", "decode", "--pd-wait-timeout-s", "2")
    front = router(
        tmp_path,
        "sglang",
        prefill=[spec(prefill.url, bootstrap=boot)],
        decode=[spec(decode.url)],
        pd={"prefill_timeout_s": 1.0, "prefill_attempts": 1},
    )
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client(front).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": LONG_PROMPT}],
                max_tokens=4,
                stream=True,
            )
        elapsed = time.monotonic() - started
        aborted = metric(front.url, "switchyard_router_pd_aborts_total", leg="decode")
    finally:
        stop(front, prefill, decode)
    assert err.value.status_code == 504
    assert err.value.body["code"] == "kv_transfer_timeout"
    assert 1.0 <= elapsed < 3
    assert aborted == 1


def test_vllm_prefill_timeout_falls_back_within_the_deadline(tmp_path: Path) -> None:
    front, prefill, decode = vllm_pair(
        tmp_path, prefill_args=("--fault-hang-rate", "1"), pd={"prefill_timeout_s": 0.5}
    )
    try:
        started = time.monotonic()
        out = client(front).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
        elapsed = time.monotonic() - started
        reason = metric(
            front.url, "switchyard_router_pd_leg_failures_total", leg="prefill", reason="timeout"
        )
    finally:
        stop(front, prefill, decode)
    assert out.usage is not None and out.usage.completion_tokens == 2
    assert reason == 1
    assert elapsed < 2


def test_vllm_prefill_timeout_without_fallback_is_a_clear_504(tmp_path: Path) -> None:
    front, prefill, decode = vllm_pair(
        tmp_path,
        prefill_args=("--fault-hang-rate", "1"),
        pd={"prefill_timeout_s": 0.5, "fallback": False},
    )
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client(front).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    finally:
        stop(front, prefill, decode)
    assert err.value.status_code == 504
    assert err.value.body["code"] == "prefill_timeout"


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_client_disconnect_aborts_the_decode_leg(tmp_path: Path, protocol: str) -> None:
    flavor = ("--flavor", protocol)
    if protocol == "sglang":
        prefill, boot = sglang_prefill()
        prefill_spec = spec(prefill.url, bootstrap=boot)
    else:
        prefill = mock("--role", "prefill")
        prefill_spec = spec(prefill.url)
    decode = mock(*flavor, "--role", "decode", "--fault-slow-stream-ms", "20")
    front = router(tmp_path, protocol, prefill=[prefill_spec], decode=[spec(decode.url)])
    name = "vllm:num_requests_running" if protocol == "vllm" else "sglang:num_running_reqs"
    try:
        stream = client(front).completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=4000, stream=True
        )
        next(iter(stream))
        streaming = metric(decode.url, name)
        stream.close()
        eventually(lambda: metric(decode.url, name) == 0, 10, 0.05)  # a ceiling, not the point
        running = metric(decode.url, name)
    finally:
        stop(front, prefill, decode)
    assert streaming == 1
    assert running == 0


def test_vllm_stalled_kv_transfer_on_a_streamed_decode_ends_in_a_504(tmp_path: Path) -> None:
    front, prefill, decode = vllm_pair(
        tmp_path, decode_args=("--fault-hang-rate", "1"), pd={"kv_transfer_timeout_s": 0.4}
    )
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client(front).completions.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=4, stream=True
            )
        elapsed = time.monotonic() - started
    finally:
        stop(front, prefill, decode)
    assert err.value.status_code == 504
    assert err.value.body["code"] == "kv_transfer_timeout"
    assert elapsed < 3
