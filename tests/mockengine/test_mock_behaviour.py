"""Engine behaviour seen through HTTP: eviction, queueing, cache reset, and the same
accounting as the virtual-clock driver for the same workload."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.virtual import simulate
from switchyard.mock.tokenizer import ModelTokenizer
from tests.support import TOKENIZER_DIR, Server, free_port

pytestmark = pytest.mark.timeout(60)


def mock(*args: str) -> Server:
    port = free_port()
    return Server(["mock", "--port", str(port), *args], port)


def complete(srv: Server, prompt: list[int] | str, max_tokens: int = 4) -> dict:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def block_prompt(first: int, blocks: int) -> list[int]:
    return list(range(first, first + 16 * blocks))


def test_small_kv_cache_evicts_old_prefixes() -> None:
    a, b, c = block_prompt(1000, 5), block_prompt(2000, 5), block_prompt(3000, 5)
    with mock("--num-gpu-blocks", "8", "--speed", "50") as srv:
        complete(srv, a)
        warm = cached(complete(srv, a))
        complete(srv, b)
        complete(srv, c)
        evicted = cached(complete(srv, a))
    assert warm >= 64
    assert evicted == 0


def test_reset_prefix_cache_forgets_cached_prompts() -> None:
    prompt = block_prompt(500, 4)
    with mock("--speed", "50") as srv:
        complete(srv, prompt)
        before = cached(complete(srv, prompt))
        assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 200
        after = cached(complete(srv, prompt))
    assert before > 0
    assert after == 0


def ttft(srv: Server, prompt: list[int] | str, max_tokens: int = 1) -> float:
    started = time.perf_counter()
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "stream": True},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise AssertionError("no token streamed")


@pytest.fixture(scope="module")
def single_seq() -> Iterator[Server]:
    with mock("--speed", "1", "--max-num-seqs", "1") as srv:
        yield srv


def test_ttft_grows_with_uncached_prompt_tokens(single_seq: Server) -> None:
    short = ttft(single_seq, block_prompt(10_000, 1))
    long = ttft(single_seq, block_prompt(20_000, 400))
    assert long > short + 0.03


async def test_ttft_grows_with_queue_depth(single_seq: Server) -> None:
    """One sequence at a time: each queued request waits for the ones before it."""

    async def one(client: httpx.AsyncClient, i: int) -> float:
        await asyncio.sleep(0.02 * i)
        started = time.perf_counter()
        body = {"prompt": block_prompt(30_000 + 1000 * i, 1), "max_tokens": 30, "stream": True}
        first = 0.0
        async with client.stream("POST", single_seq.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not first and line.startswith("data: {"):
                    first = time.perf_counter() - started
        assert first, "no token streamed"
        return first

    async with httpx.AsyncClient(timeout=30) as client:
        waits = await asyncio.gather(*(one(client, i) for i in range(3)))
    assert waits[0] + 0.05 < waits[1] < waits[2] - 0.05


def test_real_clock_server_and_virtual_clock_agree_on_accounting() -> None:
    shared = block_prompt(40_000, 4)
    prompts = [shared + block_prompt(50_000 + 100 * i, 1 + i % 3) for i in range(6)]
    prompts.append(prompts[2])
    max_tokens = [3, 20, 7, 1, 16, 9, 5]
    with mock("--speed", "100") as srv:
        served = [complete(srv, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    filler = ModelTokenizer(TOKENIZER_DIR).filler_token_id
    arrivals = [
        (10.0 * i, EngineRequest(f"r{i}", p, n, output_token_ids=[filler]))
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    simulated = simulate(EngineConfig(), arrivals)
    assert [u["completion_tokens"] for u in served] == [r.output_tokens for r in simulated]
    assert [cached(u) for u in served] == [r.num_cached_tokens for r in simulated]
    assert cached(served[-1]) > 0


def test_cache_salt_isolates_prefix_cache_between_tenants() -> None:
    prompt = block_prompt(60_000, 4)
    with mock("--speed", "50") as srv:

        def salted(salt: str) -> int:
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 1, "cache_salt": salt},
            )
            return cached(r.json()["usage"])

        salted("tenant-a")
        other_tenant = salted("tenant-b")
        same_tenant = salted("tenant-a")
    assert other_tenant == 0
    assert same_tenant > 0


def test_prompt_larger_than_the_kv_cache_is_rejected_not_queued_forever() -> None:
    with mock("--num-gpu-blocks", "8", "--speed", "50") as srv:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": block_prompt(1, 9), "max_tokens": 1},
            timeout=5,
        )
    assert r.status_code == 400
    # Eight blocks of 16, less vLLM's null block: 112 tokens fit in one sequence.
    assert "maximum context length is 112 tokens" in r.json()["error"]["message"]
