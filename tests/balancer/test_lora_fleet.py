"""The fleet knows each worker's LoRA adapters: which it lists (with their base model, from
``/v1/models``), which run or wait and how many slots it has (from the newest series of
``vllm:lora_requests_info``), and it reads models again when asked, at most once per
``model_refresh_on_miss_s`` for a whole-fleet read."""

from __future__ import annotations

import httpx
import orjson
import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.scrape import Scrape, parse_metrics
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import LoraSample
from switchyard.mock.settings import MockSettings
from tests.router.mock_engines import mock_engines

pytestmark = pytest.mark.timeout(30)

# vLLM 0.32's shape: no engine label, every label set it ever set stays, valued by time.
LORA_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 2.0
vllm:num_requests_waiting{engine="0",model_name="base"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="A",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="A,B",waiting_lora_adapters="C"} 1.8e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
"""


def test_the_newest_lora_series_is_the_engines_state() -> None:
    scrape = parse_metrics(LORA_TEXT)
    assert scrape.lora == LoraSample(("A", "B"), ("C",), 2)
    assert scrape.total is not None and scrape.total.running == 2


def test_a_scrape_shared_between_processes_keeps_its_lora_state() -> None:
    scrape = parse_metrics(LORA_TEXT)
    again = Scrape.from_json(orjson.loads(orjson.dumps(scrape, option=orjson.OPT_NON_STR_KEYS)))
    assert again.lora == scrape.lora


def test_a_free_slot_counts_running_and_waiting_adapters() -> None:
    assert LoraSample(("A",), (), 2).free_slot
    assert not LoraSample(("A",), ("B",), 2).free_slot
    assert not LoraSample(("A", "B"), (), 2).free_slot


def test_an_engine_without_lora_has_no_lora_state() -> None:
    assert parse_metrics(LORA_TEXT.split("# HELP vllm:lora")[0]).lora is None


def lora_engine(model: str = "base") -> MockSettings:
    return MockSettings(
        model=model,
        enable_lora=True,
        max_loras=2,
        lora_modules=["A=/adapters/a"],
        runtime_lora_updating=True,
        speed=100.0,
    )


async def test_models_with_a_parent_are_adapters_of_that_base_model() -> None:
    async with mock_engines(lora_engine()) as (engine,):
        fleet = Fleet(BalancerSettings(workers=[engine.url]))
        await fleet.start()
        try:
            (worker,) = fleet.workers()
            assert worker.models == {"base", "A"}
            assert worker.adapters == {"A": "base"}
            assert fleet.parent_of("A") == "base"
            assert fleet.parent_of("base") is None
            assert worker.describe()["adapters"] == {"A": "base"}
        finally:
            await fleet.stop()


async def test_a_miss_reads_every_workers_models_once_per_interval() -> None:
    async with mock_engines(lora_engine()) as (engine,):
        settings = BalancerSettings(workers=[engine.url], model_refresh_on_miss_s=60.0)
        fleet = Fleet(settings)
        await fleet.start()
        try:
            (worker,) = fleet.workers()
            async with httpx.AsyncClient(base_url=engine.url) as client:
                body = {"lora_name": "B", "lora_path": "/adapters/b"}
                assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
                await fleet.refresh_models()
                assert fleet.parent_of("B") == "base"
                body = {"lora_name": "C", "lora_path": "/adapters/c"}
                assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
            await fleet.refresh_models()  # within the interval: nothing read
            assert not fleet.has_model("C")
            await fleet.refresh_models([worker])  # a named worker is read at once
            assert fleet.parent_of("C") == "base"
        finally:
            await fleet.stop()


async def test_a_scrape_gives_the_worker_its_adapters_in_use_and_slots() -> None:
    async with mock_engines(lora_engine()) as (engine,):
        fleet = Fleet(BalancerSettings(workers=[engine.url]))
        await fleet.start()
        try:
            (worker,) = fleet.workers()
            prober = fleet.prober
            assert prober is not None
            await prober._scrape(worker)
            assert worker.lora == LoraSample((), (), 2)
        finally:
            await fleet.stop()
