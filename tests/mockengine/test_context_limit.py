"""A request longer than the served context is refused at the API with vLLM's 400, and one
that just fits is served: the engine core never sees a request it could not schedule."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from switchyard.mock.engine.api import context_length_error
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.serve import build
from switchyard.mock.settings import MockSettings

pytestmark = pytest.mark.timeout(30)

# Eight blocks of 16 tokens, less vLLM's null block: one sequence holds 112 tokens.
BLOCKS, BLOCK_SIZE, FITS = 8, 16, 112


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = MockSettings(num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE, speed=100.0)
    (endpoint,) = build(settings).endpoints
    for engine in endpoint.engines:
        await engine.start()
    transport = httpx.ASGITransport(app=endpoint.app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://mock.test") as c:
            yield c
    finally:
        for engine in endpoint.engines:
            await engine.stop()


def test_the_served_context_is_the_model_length_capped_by_the_kv_cache() -> None:
    config = EngineConfig(num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE)
    assert config.kv_capacity_tokens == FITS
    assert config.context_limit(131_072) == FITS
    assert config.context_limit(100) == 100


def test_the_message_is_vllms() -> None:
    assert context_length_error(112, 100, 12) is None
    assert context_length_error(112, 100, 13) == (
        "This model's maximum context length is 112 tokens. However, you requested 113 tokens "
        "(100 in the messages, 13 in the completion). Please reduce the length of the messages "
        "or completion."
    )


async def test_models_reports_the_served_context(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.json()["data"][0]["max_model_len"] == FITS


async def test_one_token_over_the_context_is_a_400_in_vllms_shape(
    client: httpx.AsyncClient,
) -> None:
    prompt = [7] * (FITS - 3)
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": context_length_error(FITS, FITS - 3, 4),
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


async def test_a_request_filling_the_whole_cache_is_served(client: httpx.AsyncClient) -> None:
    prompt = [7] * (FITS - 4)
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200
    assert r.json()["usage"] == {
        "prompt_tokens": FITS - 4,
        "total_tokens": FITS,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_the_engine_goes_on_serving_after_a_refusal(client: httpx.AsyncClient) -> None:
    refused = await client.post("/v1/completions", json={"prompt": [1] * 500, "max_tokens": 1})
    served = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert (refused.status_code, served.status_code) == (400, 200)
