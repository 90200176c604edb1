"""Disaggregated prefill/decode on real vLLM: the router's vLLM P/D flow over NixlConnector.

Two engines with NixlConnector (the ``pd_pair`` fixture) serve as the prefill
(``pd_pair[0]``) and the decode engine (``pd_pair[1]``). vLLM counts each prompt token by
where its KV came from (``vllm:prompt_tokens_by_source_total``): the prefill engine
computes the prompt, the decode engine receives it over NIXL (``external_kv_transfer``)
and computes none of it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from switchyard.loadtest.prom import values
from tests.real.conftest import MODEL, reset_caches
from tests.support import TOKENIZER_DIR, Server, free_port, one_process
from tools.realvllm import VllmEngine

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prompt_sources(engine: VllmEngine) -> dict[str, float]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return {s: sum(values(text, "vllm:prompt_tokens_by_source_total", source=s)) for s in SOURCES}


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {s: after[s] - before[s] for s in SOURCES}


def unique_chat() -> list[dict[str, str]]:
    """A prompt of several blocks no engine has cached."""
    topic = uuid.uuid4().hex
    return [{"role": "user", "content": f"Notes on case {topic}: " + "the harbour light " * 60}]


@pytest.fixture
def pd_router(pd_pair: list[VllmEngine]) -> Iterator[Server]:
    reset_caches(pd_pair)
    prefill, decode = pd_pair
    port = free_port()
    argv = ["router", "--port", str(port), "--pd-protocol", "vllm"]
    argv += ["--prefill", prefill.url, "--decode", decode.url]
    argv += ["--tokenizer", str(TOKENIZER_DIR), "--log-level", "warning", "--no-kv-parity"]
    argv += one_process()
    # A cold router start can take over a minute when the engines keep the cores busy.
    server = Server(argv, port, "/ready").start(timeout=180)
    yield server
    server.stop()


def test_decode_engine_answers_with_kv_moved_from_the_prefill_engine(
    pd_router: Server, pd_pair: list[VllmEngine]
) -> None:
    prefill, decode = pd_pair
    before = [prompt_sources(e) for e in pd_pair]
    body = {"model": MODEL, "messages": unique_chat(), "max_tokens": 8, "ignore_eos": True}
    resp = httpx.post(pd_router.url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-switchyard-worker"] == decode.url
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    on_prefill = moved(before[0], prompt_sources(prefill))
    on_decode = moved(before[1], prompt_sources(decode))
    assert on_prefill["local_compute"] == prompt_tokens
    assert on_decode == {
        "local_compute": 0,
        "local_cache_hit": 0,
        "external_kv_transfer": prompt_tokens,
    }


def test_a_streamed_pd_answer_completes_through_the_openai_sdk(
    pd_router: Server, pd_pair: list[VllmEngine]
) -> None:
    decode = pd_pair[1]
    before = prompt_sources(decode)
    client = openai.OpenAI(base_url=pd_router.url + "/v1", api_key="unused", timeout=300)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=unique_chat(),  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and finish == ["length"]
    assert usage is not None and usage.completion_tokens == 6
    on_decode = moved(before, prompt_sources(decode))
    assert on_decode["external_kv_transfer"] == usage.prompt_tokens
    assert on_decode["local_compute"] == 0
