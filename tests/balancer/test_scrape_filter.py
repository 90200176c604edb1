"""What reaches the Prometheus parser when the balancer reads an engine's /metrics."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import switchyard.balancer.scrape as scrape
from switchyard.balancer.scrape import parse_metrics

REAL_VLLM = Path(__file__).parents[1] / "fixtures" / "vllm_real" / "metrics.txt"


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The texts handed to the parser, from a cold line memo."""
    seen: list[str] = []

    def recording(text: str) -> Iterable[Metric]:
        seen.append(text)
        return text_string_to_metric_families(text)

    scrape._parse_line.cache_clear()
    monkeypatch.setattr(scrape, "text_string_to_metric_families", recording)
    yield seen
    scrape._parse_line.cache_clear()


def test_histogram_buckets_and_other_families_never_reach_the_parser(parsed: list[str]) -> None:
    result = parse_metrics(REAL_VLLM.read_text())
    assert result.flavor == "vllm" and result.total is not None
    assert parsed, "the load families were parsed"
    assert not [t for t in parsed if "_bucket" in t or t.startswith(("#", "python_", "process_"))]


def test_a_line_seen_before_is_not_parsed_again(parsed: list[str]) -> None:
    text = REAL_VLLM.read_text()
    first = parse_metrics(text)
    parsed.clear()
    assert parse_metrics(text) == first
    assert parsed == []


def test_a_malformed_line_of_another_family_does_not_end_the_reading() -> None:
    text = 'vllm:some_other_metric{engine="0" 1\nvllm:num_requests_running{engine="0"} 2\n'
    total = parse_metrics(text).total
    assert total is not None and total.running == 2


def test_a_malformed_load_line_ends_the_reading_with_what_came_before() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="0" 5\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    )
    total = parse_metrics(text).total
    assert total is not None and (total.running, total.waiting, total.kv_usage) == (2, 0, None)


def test_flavor_comes_from_the_first_engine_sample_of_any_family() -> None:
    text = "sglang:gen_throughput 3.0\nvllm:num_requests_running 1\n"
    assert parse_metrics(text).flavor == "sglang"


def test_new_values_of_series_seen_before_are_read_without_the_parser(
    parsed: list[str],
) -> None:
    line = 'vllm:num_requests_running{engine="0",model_name="m"} '
    parse_metrics(line + "2\n")
    parsed.clear()
    total = parse_metrics(line + "7\n").total
    assert total is not None and total.running == 7
    assert parsed == []


def test_a_sample_with_a_timestamp_keeps_its_value() -> None:
    total = parse_metrics('vllm:num_requests_waiting{engine="0"} 4 1712345678000\n').total
    assert total is not None and total.waiting == 4


def test_a_longer_name_that_shares_a_wanted_prefix_never_reaches_the_parser(
    parsed: list[str],
) -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 3\n'
        'vllm:num_requests_waiting{engine="0"} 1\n'
    )
    total = parse_metrics(text).total
    assert total is not None and total.waiting == 1
    assert not [t for t in parsed if "by_reason" in t]
