"""Engine-side load signals: /metrics parsing for vLLM and SGLang, staleness, the load model."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.probe import apply_scrape
from switchyard.balancer.scrape import Scrape, parse_metrics
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import EngineSample, WorkerSpec
from tests.balancer.fleet_stubs import StubFactory, eventually
from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(30)

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1
"""

SGLANG = """sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 7.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 4.0
sglang:token_usage{engine_type="unified",model_name="m",tp_rank="0"} 0.25
"""


def test_vllm_metrics_sum_over_ranks_and_split_per_rank() -> None:
    scrape = parse_metrics(VLLM)
    assert scrape.flavor == "vllm"
    assert (scrape.total.running, scrape.total.waiting) == (4, 2)
    assert scrape.total.kv_usage == pytest.approx(0.3)
    assert scrape.ranks[0].running == 3 and scrape.ranks[1].kv_usage == pytest.approx(0.1)


def test_sglang_metrics_are_recognised() -> None:
    scrape = parse_metrics(SGLANG)
    assert scrape.flavor == "sglang"
    assert (scrape.total.running, scrape.total.waiting, scrape.total.kv_usage) == (7, 4, 0.25)
    assert scrape.ranks == {}


def test_older_vllm_gpu_cache_usage_name_is_accepted() -> None:
    text = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.75\n"
    assert parse_metrics(text).total.kv_usage == 0.75


def test_kv_capacity_turns_usage_into_tokens() -> None:
    info = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0\n'
    )
    scrape = parse_metrics(VLLM + info)
    assert scrape.ranks[0].kv_tokens == 8000 and scrape.ranks[1].kv_tokens == 1600
    sglang = parse_metrics(SGLANG + 'sglang:max_total_num_tokens{tp_rank="0"} 40000\n')
    assert sglang.total.kv_tokens == 10000


def test_engine_kv_beyond_router_counts_steers_step_balanced() -> None:
    """Tokens the router cannot see (generated output, other clients) come from the scrape."""
    fleet = Fleet(BalancerSettings(dp_policy="step_balanced"))
    worker = fleet.add(WorkerSpec("http://127.0.0.1:9", dp_size=2))
    fleet.begin(worker, prompt_tokens=1000, dp_rank=0)
    fleet.begin(worker, prompt_tokens=1000, dp_rank=1)
    ranks = {0: EngineSample(1, 0, 0.5, 30000), 1: EngineSample(1, 0, 0.05, 1000)}
    apply_scrape(worker, [Scrape("vllm", EngineSample(2, 0, 0.3), ranks)])
    assert [r.hidden_tokens for r in worker.ranks] == [29000, 0]
    assert fleet.choose_rank(worker, prompt_tokens=100) == 1


def test_unrelated_metrics_give_no_sample() -> None:
    scrape = parse_metrics("process_cpu_seconds_total 12.0\n")
    assert scrape.total is None and scrape.flavor is None


async def test_scraped_load_enters_the_load_model_and_goes_stale(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine(metrics=SGLANG)
    settings = BalancerSettings(
        probe_interval_s=0.1, scrape_interval_s=0.1, scrape_staleness_s=0.3, kv_usage_weight=4.0
    )
    fleet = Fleet(settings, [WorkerSpec(stub.url)])
    await fleet.start()
    try:
        worker = fleet.get(stub.url)
        await eventually(lambda: not worker.load().stale)
        assert worker.flavor == "sglang"
        load = worker.load()
        assert (load.engine_running, load.engine_waiting) == (7, 4)
        assert load.requests == 11 and load.score == pytest.approx(11 + 4 + 4 * 0.25)
        fleet.begin(worker)
        assert worker.load().requests == 12, "requests sent since the scrape count on top"
        await stub.stop()
        await asyncio.sleep(0.45)
        stale = worker.load()
        assert stale.stale and stale.engine_running is None
        assert stale.requests == 1, "stale engine numbers fall back to router-side counts"
    finally:
        await fleet.stop()


async def test_mock_engine_with_dp_ranks_is_scraped_per_rank() -> None:
    port = free_port()
    mock = Server(["mock", "--port", str(port), "--dp-size", "2", "--model", "tiny"], port)
    await asyncio.to_thread(mock.start)
    fleet = Fleet(BalancerSettings(probe_interval_s=0.1, scrape_interval_s=0.1))
    worker = fleet.add(WorkerSpec(mock.url, dp_size=2))
    await fleet.start()
    try:
        await eventually(lambda: bool(worker.models) and not worker.load().stale, timeout=10)
        assert worker.models == {"tiny"}
        assert worker.flavor == "vllm"
        assert sorted(worker.engine_ranks) == [0, 1]
        assert [r.engine_running for r in worker.rank_loads()] == [0, 0]
        assert all(
            s.kv_tokens is not None and 0 <= s.kv_tokens < 100 for s in worker.engine_ranks.values()
        )
    finally:
        await fleet.stop()
        await asyncio.to_thread(mock.stop)
