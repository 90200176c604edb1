"""LoRA adapters through the router: an adapter's requests go only to workers that list it,
prefer the one running it, find its own cached prefix (its blocks are keyed with its
name), and the admin API places adapters by rendezvous hashing, ahead of time or on the
first request that names one."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import httpx
import pytest

from switchyard.balancer.adapters import rendezvous
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import LoraSample, Worker, WorkerSpec
from switchyard.loadtest.prom import values
from switchyard.mock.settings import MockSettings
from switchyard.router.scheduler.framework import Context
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.scheduler.scorers import LoraAffinityScorer
from tests.router.inprocess import running_router
from tests.router.mock_engines import mock_engines
from tests.support import TOKENIZER_DIR, eventually_async, free_port

pytestmark = pytest.mark.timeout(60)

ADMIN = {"authorization": "Bearer adm"}
WORKER = "x-switchyard-worker"
BLOCK = 16  # the mock's block size
PROMPT = "You are a careful assistant who answers in full sentences. " * 60


def engine(*modules: str, events: bool = True) -> MockSettings:
    return MockSettings(
        model="m",
        enable_lora=True,
        max_loras=2,
        lora_modules=list(modules),
        runtime_lora_updating=True,
        speed=100.0,
        kv_events_port=free_port() if events else None,
        # A router that subscribes after the first events replays them from here.
        kv_events_replay_port=free_port() if events else None,
    )


def completion(model: str, prompt: str = PROMPT) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 2}


def worker(name: str, lora: LoraSample | None) -> Worker:
    w = Worker(WorkerSpec(f"http://{name}:8000"), BalancerSettings())
    w.lora = lora
    return w


def test_affinity_prefers_running_then_a_free_slot_then_waiting() -> None:
    workers = [
        worker("running", LoraSample(("A",), (), 1)),
        worker("free", LoraSample(("B",), (), 2)),
        worker("waiting", LoraSample(("B",), ("A",), 1)),
        worker("busy", LoraSample(("B",), (), 1)),
        worker("unscraped", None),
    ]
    scores = LoraAffinityScorer().score(Context(model="A", lora_name="A"), workers)
    assert scores == [1.0, 0.8, 0.6, 0.0, 0.8]


def test_a_base_model_request_is_ranked_as_kv_aware_alone_ranks_it() -> None:
    """The affinity scorer abstains: it neither adds weight nor compresses the cost's
    differences, which the picker's relative tie tolerance reads."""
    workers = [worker(f"w{i}", LoraSample((), (), 1)) for i in range(3)]
    workers[0].totals.prefill_tokens = 400
    workers[1].totals.prefill_tokens = 390
    plain = build_scheduler("custom", {"scorers": {"kv_aware": 1.0}})
    both = build_scheduler("kv_aware")
    ctx = Context(model="m", prompt_tokens=100)
    assert both.combined_scores(ctx, workers) == plain.combined_scores(ctx, workers)
    with_lora = Context(model="A", prompt_tokens=100, lora_name="A")
    assert both.combined_scores(with_lora, workers) != plain.combined_scores(with_lora, workers)


async def test_an_adapter_goes_only_where_it_is_listed_and_finds_its_own_prefix() -> None:
    async with mock_engines(engine("A=/adapters/a"), engine("B=/adapters/b")) as engines:
        urls = [e.url for e in engines]
        async with running_router(
            *urls, policy="kv_aware", tokenizer=str(TOKENIZER_DIR), kv_parity=False
        ) as router:
            served: dict[str, set[str]] = {"A": set(), "B": set()}
            cached: list[int] = []
            source = router.app.kv.source

            async def holds(name: str, worker: str, tokens: int) -> bool:
                found = await source.lookup("m", {"prompt": PROMPT}, None, [worker], name)
                return max((m.matched_tokens for m in found.matches), default=0) >= tokens

            async def followed(name: str, worker: str, tries: list[int]) -> bool:
                """A distinct warm-up prompt until the worker's events reach the index: a
                subscriber that joined after a batch left learns of it from the next one."""
                tries[0] += 1
                warm = completion(name, f"warm-up {tries[0]} " * 40)
                assert (await router.post("/v1/completions", json=warm)).status_code == 200
                return (await source.occupancy()).get(worker, 0) > 0

            for name, url in zip(("A", "B"), urls, strict=True):
                await eventually_async(functools.partial(followed, name, url, [0]), interval_s=0.1)
            before = await router.get("/metrics")
            was = sum(values(before.text, "switchyard_router_predicted_cached_tokens_total"))
            for _ in range(3):
                for name in ("A", "B"):
                    r = await router.post("/v1/completions", json=completion(name))
                    assert r.status_code == 200, r.text
                    assert r.json()["model"] == name
                    served[name].add(r.headers[WORKER])
                    usage = r.json()["usage"]
                    cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                    # The next request is predicted once the engine's events are indexed.
                    full = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
                    await eventually_async(functools.partial(holds, name, r.headers[WORKER], full))
            assert served == {"A": {urls[0]}, "B": {urls[1]}}
            # The base model's request on the same text finds none of the adapters' blocks.
            base = await router.post("/v1/completions", json=completion("m"))
            cached.append(base.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert cached[-1] == 0
            assert all(c > 0 for c in cached[2:-1])
            text = (await router.get("/metrics")).text
            now = sum(values(text, "switchyard_router_predicted_cached_tokens_total"))
            assert now - was == sum(cached)


async def test_an_adapter_loaded_outside_the_router_is_found_by_its_first_request() -> None:
    async with mock_engines(engine(events=False)) as (only,):
        async with running_router(only.url) as router:
            async with httpx.AsyncClient(base_url=only.url) as client:
                body = {"lora_name": "late", "lora_path": "/adapters/late"}
                assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
            r = await router.post("/v1/completions", json=completion("late", "hello"))
            assert r.status_code == 200
            missing = await router.post("/v1/completions", json=completion("nobody", "hello"))
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"


async def test_the_admin_api_loads_an_adapter_on_rendezvous_chosen_replicas() -> None:
    async with mock_engines(*(engine(events=False) for _ in range(3))) as engines:
        urls = [e.url for e in engines]
        async with running_router(*urls, admin_api_key="adm") as router:
            fleet = router.app.fleet
            chosen = [w.id for w in rendezvous("C", fleet.workers())[:2]]
            body = {"name": "C", "path": "/adapters/c", "replicas": 2}
            r = await router.post("/admin/adapters", json=body, headers=ADMIN)
            assert r.status_code == 200, r.text
            assert r.json() == {
                "adapter": "C",
                "base_model": "m",
                "workers": dict.fromkeys(chosen, "loaded"),
            }
            listed = (await router.get("/admin/adapters", headers=ADMIN)).json()["adapters"]
            assert [(a["name"], a["workers"], a["registered"]) for a in listed] == [
                ("C", sorted(chosen), True)
            ]
            for _ in range(6):
                r = await router.post("/v1/completions", json=completion("C", "hi"))
                assert r.status_code == 200
                assert r.headers[WORKER] in chosen
            gone = await router.client.delete(
                "/admin/adapters", params={"name": "C"}, headers=ADMIN
            )
            assert gone.json()["workers"] == dict.fromkeys(chosen, "unloaded")
            r = await router.post("/v1/completions", json=completion("C", "hi"))
            assert r.status_code == 404


async def test_a_registered_adapter_is_placed_by_the_first_request_naming_it() -> None:
    async with mock_engines(*(engine(events=False) for _ in range(3))) as engines:
        urls = [e.url for e in engines]
        async with running_router(*urls, admin_api_key="adm") as router:
            first = rendezvous("D", router.app.fleet.workers())[0].id
            body = {"name": "D", "path": "/adapters/d", "replicas": 0}
            r = await router.post("/admin/adapters", json=body, headers=ADMIN)
            assert (r.status_code, r.json()["workers"]) == (200, {})
            results = await asyncio.gather(
                *(router.post("/v1/completions", json=completion("D", "hi")) for _ in range(4))
            )
            assert [r.status_code for r in results] == [200] * 4
            assert {r.headers[WORKER] for r in results} == {first}
            holders = [w.id for w in router.app.fleet.workers() if "D" in w.adapters]
            assert holders == [first]


async def test_an_adapter_for_a_model_nobody_serves_is_refused() -> None:
    async with mock_engines(engine(events=False)) as (only,):
        async with running_router(only.url, admin_api_key="adm") as router:
            body = {"name": "E", "path": "/e", "base_model": "other"}
            r = await router.post("/admin/adapters", json=body, headers=ADMIN)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found"
