"""/metrics of both flavours match the engines' names, types and label names (goldens)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.prom import samples, totals
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
