"""The mock engine serves LoRA adapters as vLLM does: known adapters are models with a
parent, at most ``max_loras`` run in a step (the least recently used slot is reloaded at a
cost), the load and unload routes exist only when runtime updating is allowed, and the
adapter's name keys its blocks and rides in its KV events."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.serve import build
from switchyard.mock.settings import MockSettings

pytestmark = pytest.mark.timeout(30)

LOAD_US = 50_000.0
BASE = "mock-model"


def core(max_loras: int = 1, sink: list[KVEventBatch] | None = None) -> EngineCore:
    config = EngineConfig(
        num_gpu_blocks=256, max_num_seqs=16, max_loras=max_loras, lora_load_us=LOAD_US
    )
    return EngineCore(config, event_sink=None if sink is None else sink.append)


def request(
    rid: str, lora: str | None, start: int = 1000, lora_id: int | None = None
) -> EngineRequest:
    return EngineRequest(rid, list(range(start, start + 40)), 4, lora_name=lora, lora_id=lora_id)


def test_a_step_runs_at_most_max_loras_adapters_and_the_others_wait() -> None:
    c = core(max_loras=1)
    c.add_request(request("a", "A"))
    c.add_request(request("b", "B"))
    c.add_request(request("base", None))
    c.step(0.0)
    assert {s.request_id for s in c.running} == {"a", "base"}
    assert c.stats().waiting_loras == {"B": 1}
    assert c.stats().running_loras == {"A": 1}


def test_loading_an_adapter_costs_its_step_the_load_time_once() -> None:
    c = core(max_loras=1)
    c.add_request(request("a1", "A"))
    first = c.step(0.0).duration
    assert first >= LOAD_US * 1e-6
    c.add_request(request("a2", "A", start=5000))
    t = first
    while c.has_work():
        step = c.step(t)
        assert step.duration < LOAD_US * 1e-6  # A stays in its slot
        t += step.duration
    assert c.lora_loads == 1


def test_the_least_recently_used_adapter_leaves_its_slot() -> None:
    c = core(max_loras=2)
    t = 0.0
    for rid, lora in (("a", "A"), ("b", "B"), ("a2", "A"), ("c", "C")):
        c.add_request(request(rid, lora, start=1000 + 100 * len(rid)))
        while c.has_work():
            t += c.step(t).duration
    assert c.lora_slots is not None
    assert list(c.lora_slots) == ["A", "C"]  # B was used least recently
    assert c.lora_loads == 3


def test_kv_events_carry_the_adapter_name_and_id_and_hashes_differ_per_adapter() -> None:
    events: list[KVEventBatch] = []
    c = core(max_loras=2, sink=events)
    c.add_request(request("a", "A", lora_id=1))
    c.add_request(request("base", None))
    while c.has_work():
        c.step(0.0)
    stored = [e for b in events for e in b.events if isinstance(e, BlockStored)]
    by_lora = {e.lora_name: e for e in stored}
    assert by_lora["A"].lora_id == 1
    assert by_lora["A"].extra_keys == [("A",), ("A",)]
    assert by_lora[None].lora_id is None
    assert set(by_lora["A"].block_hashes).isdisjoint(by_lora[None].block_hashes)


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    flags = getattr(request, "param", {})
    settings = MockSettings(
        enable_lora=True,
        max_loras=2,
        lora_modules=["A=/adapters/a"],
        lora_load_ms=1.0,
        speed=100.0,
        **flags,
    )
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


async def test_models_lists_adapters_with_their_parent_and_path(
    served: httpx.AsyncClient,
) -> None:
    data = (await served.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in data] == [
        (BASE, None, BASE),
        ("A", BASE, "/adapters/a"),
    ]


async def test_a_request_names_a_known_adapter_and_is_answered_as_it(
    served: httpx.AsyncClient,
) -> None:
    r = await served.post("/v1/completions", json={"model": "A", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["model"] == "A"


async def test_an_unknown_adapter_is_vllms_404(served: httpx.AsyncClient) -> None:
    r = await served.post("/v1/completions", json={"model": "Z", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `Z` does not exist."


async def test_without_runtime_updating_the_load_route_does_not_exist(
    served: httpx.AsyncClient,
) -> None:
    r = await served.post("/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": "/b"})
    assert r.status_code == 404


@pytest.mark.parametrize("served", [{"runtime_lora_updating": True}], indirect=True)
async def test_load_and_unload_at_run_time_answer_as_vllm(served: httpx.AsyncClient) -> None:
    r = await served.post("/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": "/b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'B' added successfully.")
    ids = [m["id"] for m in (await served.get("/v1/models")).json()["data"]]
    assert ids == [BASE, "A", "B"]
    again = await served.post("/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": "/b"})
    assert again.status_code == 400
    assert again.json()["error"]["type"] == "InvalidUserInput"
    ok = await served.post("/v1/completions", json={"model": "B", "prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200
    gone = await served.post("/v1/unload_lora_adapter", json={"lora_name": "B"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'B' removed successfully.")
    missing = await served.post("/v1/unload_lora_adapter", json={"lora_name": "B"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'B' cannot be found."
    after = await served.post(
        "/v1/completions", json={"model": "B", "prompt": "x", "max_tokens": 1}
    )
    assert after.status_code == 404


async def test_metrics_report_lora_requests_info_with_the_newest_series_last_set(
    served: httpx.AsyncClient,
) -> None:
    await served.post("/v1/completions", json={"model": "A", "prompt": "hi", "max_tokens": 1})
    text = (await served.get("/metrics")).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
    ]
    newest = max(family.samples, key=lambda s: s.value)
    assert newest.labels["max_lora"] == "2"
    assert set(newest.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
