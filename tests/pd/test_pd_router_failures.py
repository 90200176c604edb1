"""Every disaggregated request ends: dead prefill or decode, transfer timeout; all bounded.

Which legs ran is counted at the mocks (``generations``, injected faults); a clock is read
only where a deadline is the point: the request ended at the router's deadline, or long
before an engine's own wait would have ended it.
"""

from __future__ import annotations

import asyncio
import time

import openai
import orjson
import pytest
from starlette.types import Message

from tests.pd.support_pd import (
    LONG_PROMPT,
    MODEL,
    Mock,
    PDRouter,
    pd_router,
    running_mock,
    vllm_pair,
)
from tests.router.conftest import dead_url
from tests.support import eventually_async

pytestmark = pytest.mark.timeout(60)

# An engine's own wait for KV that a router which did not abort would sit through.
LONG_WAIT_S = 30.0


def dead(**options: object) -> str:
    """A prefill or decode worker nothing listens on (connections are refused at once)."""
    extra = "".join(f";{k}={v}" for k, v in options.items())
    return f"{dead_url()};models={MODEL}{extra}"


async def test_vllm_dead_prefill_falls_back_to_the_whole_request_on_decode() -> None:
    async with (
        running_mock(role="decode") as decode,
        pd_router("vllm", prefill=[dead()], decode=[decode]) as front,
    ):
        raw = await front.openai.completions.with_raw_response.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=4
        )
        fallbacks = await front.metric("switchyard_router_pd_fallbacks_total")
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert "x-mock-remote-prefill-tokens" not in raw.headers
    assert fallbacks == 1
    assert decode.generations == 1  # the whole request, once


async def test_vllm_prefill_failure_is_retried_on_another_prefill_worker() -> None:
    async with (
        running_mock(role="prefill", fault_error_rate=1) as failing,
        running_mock(role="prefill") as prefill,
        running_mock(role="decode") as decode,
        pd_router(
            "vllm",
            prefill=[failing, prefill],
            decode=[decode],
            pd={"prefill_policy": "round_robin"},
        ) as front,
    ):
        outs = [
            await front.openai.completions.with_raw_response.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=2
            )
            for _ in range(2)
        ]
        failures = await front.metric("switchyard_router_pd_leg_failures_total", leg="prefill")
    assert all("x-mock-remote-prefill-tokens" in o.headers for o in outs)
    assert failures == failing.faults("error") >= 1
    assert prefill.generations == 2
    assert decode.generations == 2


async def test_sglang_failed_prefill_aborts_the_waiting_decode_leg_with_a_clear_error() -> None:
    async with (
        running_mock(flavor="sglang", role="prefill", fault_error_rate=1) as prefill,
        running_mock(flavor="sglang", role="decode", pd_wait_timeout_s=LONG_WAIT_S) as decode,
        pd_router(
            "sglang", prefill=[prefill], decode=[decode], pd={"prefill_attempts": 1}
        ) as front,
    ):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await front.openai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
        elapsed = time.monotonic() - started
        aborted = await front.metric(
            "switchyard_router_pd_aborts_total", leg="decode", reason="status_500"
        )
    assert err.value.status_code == 502
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "pd_prefill_failed"
    assert (prefill.faults("error"), decode.generations) == (1, 1)
    assert aborted == 1
    # The decode leg would have waited LONG_WAIT_S for KV: the router aborted it instead.
    assert elapsed < LONG_WAIT_S / 3


async def test_sglang_dead_prefill_ends_in_a_clear_error_without_waiting() -> None:
    async with (
        running_mock(flavor="sglang", role="decode", pd_wait_timeout_s=LONG_WAIT_S) as decode,
        pd_router("sglang", prefill=[dead(bootstrap=1)], decode=[decode]) as front,
    ):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await front.openai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
        elapsed = time.monotonic() - started
    assert err.value.status_code in (502, 503)
    assert isinstance(err.value.body, dict)
    assert err.value.body["code"] in ("pd_prefill_failed", "pd_no_prefill")
    # The decode leg, if sent, would have waited LONG_WAIT_S for KV from a dead prefill.
    assert elapsed < LONG_WAIT_S / 3


async def test_dead_decode_is_retried_on_another_decode_before_the_first_byte() -> None:
    async with (
        running_mock(role="prefill") as prefill,
        running_mock(role="decode") as decode,
        pd_router(
            "vllm",
            prefill=[prefill],
            decode=[dead(), decode],
            pd={"decode_policy": "round_robin"},
        ) as front,
    ):
        streams = []
        for _ in range(2):
            stream = await front.openai.completions.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=3, stream=True
            )
            streams.append([c async for c in stream])
        remote = await decode.metric("mockengine_remote_prefills_total")
    assert all(sum(1 for c in s if c.choices and c.choices[0].text) == 3 for s in streams)
    assert remote == 2
    assert (prefill.generations, decode.generations) == (2, 2)  # no leg ran twice


async def test_sglang_transfer_timeout_ends_in_a_504_and_aborts_both_legs() -> None:
    async with (
        running_mock(flavor="sglang", role="prefill", fault_hang_rate=1) as prefill,
        # The decode's own bootstrap wait (2 s) outlasts the router's transfer deadline (1 s).
        running_mock(flavor="sglang", role="decode", pd_wait_timeout_s=2) as decode,
        pd_router(
            "sglang",
            prefill=[prefill],
            decode=[decode],
            pd={"prefill_timeout_s": 1.0, "prefill_attempts": 1},
        ) as front,
    ):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await front.openai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": LONG_PROMPT}],
                max_tokens=4,
                stream=True,
            )
        elapsed = time.monotonic() - started
        aborted = await front.metric("switchyard_router_pd_aborts_total", leg="decode")
    assert err.value.status_code == 504
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "kv_transfer_timeout"
    assert (prefill.faults("hang"), decode.generations) == (1, 1)
    assert aborted == 1
    # The deadline is the point: ended by the router's 1 s, not before, nor by the decode's 2 s.
    assert 1.0 <= elapsed < 3


async def test_vllm_prefill_timeout_falls_back_within_the_deadline() -> None:
    hung = {"fault_hang_rate": 1}
    async with vllm_pair(prefill=hung, pd={"prefill_timeout_s": 0.5}) as (front, prefill, decode):
        started = time.monotonic()
        out = await front.openai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
        elapsed = time.monotonic() - started
        reason = await front.metric(
            "switchyard_router_pd_leg_failures_total", leg="prefill", reason="timeout"
        )
    assert out.usage is not None and out.usage.completion_tokens == 2
    assert reason == 1
    assert (prefill.faults("hang"), decode.generations) == (1, 1)
    # The deadline is the point: the fallback starts at the 0.5 s prefill timeout.
    assert elapsed < 2


async def test_vllm_prefill_timeout_without_fallback_is_a_clear_504() -> None:
    hung = {"fault_hang_rate": 1}
    pd = {"prefill_timeout_s": 0.5, "fallback": False}
    async with vllm_pair(prefill=hung, pd=pd) as (front, prefill, decode):
        with pytest.raises(openai.APIStatusError) as err:
            await front.openai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert err.value.status_code == 504
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "prefill_timeout"
    assert (prefill.faults("hang"), decode.generations) == (1, 0)


async def first_chunk_then_gone(front: PDRouter, decode: Mock, name: str) -> float:
    """Stream a long completion straight into the router app, read its first chunk, then
    disconnect; the decode engine's ``name`` gauge while the stream ran."""
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4000, "stream": True}
    messages: list[Message] = [{"type": "http.request", "body": orjson.dumps(body)}]
    first_chunk, gone = asyncio.Event(), asyncio.Event()

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
    }
    request = asyncio.create_task(front.app(scope, receive, send))
    await asyncio.wait_for(first_chunk.wait(), 20)
    streaming = await decode.metric(name)
    gone.set()
    await asyncio.wait_for(request, 10)
    return streaming


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_client_disconnect_aborts_the_decode_leg(protocol: str) -> None:
    name = "vllm:num_requests_running" if protocol == "vllm" else "sglang:num_running_reqs"
    async with (
        running_mock(flavor=protocol, role="prefill") as prefill,
        running_mock(flavor=protocol, role="decode", fault_slow_stream_ms=20) as decode,
        pd_router(protocol, prefill=[prefill], decode=[decode]) as front,
    ):
        streaming = await first_chunk_then_gone(front, decode, name)

        async def stopped() -> bool:
            return await decode.metric(name) == 0

        await eventually_async(stopped, 10, 0.02)  # a ceiling, not the point
        running = await decode.metric(name)
    assert streaming == 1
    assert running == 0


async def test_vllm_stalled_kv_transfer_on_a_streamed_decode_ends_in_a_504() -> None:
    hung = {"fault_hang_rate": 1}
    async with vllm_pair(decode=hung, pd={"kv_transfer_timeout_s": 0.4}) as (front, _, decode):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            await front.openai.completions.create(
                model=MODEL, prompt=LONG_PROMPT, max_tokens=4, stream=True
            )
        elapsed = time.monotonic() - started
    assert err.value.status_code == 504
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "kv_transfer_timeout"
    assert decode.faults("hang") >= 1  # the stall was the decode's
    # The deadline is the point: the 0.4 s transfer timeout ended it, not the hung engine.
    assert elapsed < 3
