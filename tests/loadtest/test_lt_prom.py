"""Prometheus text is read with prometheus_client's parser: names, labels and sums."""

from __future__ import annotations

from switchyard.loadtest.prom import histogram_quantile, labels_of, totals, values

TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop"} 4.0
vllm:request_success_total{engine="0",finished_reason="abort"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="29000"} 1.0
# TYPE odd gauge
odd{path="a \\"quoted\\" value"} 7.0
"""


def test_totals_sum_each_sample_name_over_its_label_sets() -> None:
    got = totals(TEXT)
    assert got["vllm:num_requests_running"] == 5.0
    assert got["vllm:request_success_total"] == 5.0


def test_values_keep_only_samples_whose_labels_match() -> None:
    assert values(TEXT, "vllm:num_requests_running", engine="1") == [3.0]
    assert values(TEXT, "vllm:request_success_total", finished_reason="abort") == [1.0]
    assert values(TEXT, "vllm:num_requests_running", engine="9") == []


def test_label_values_are_unescaped() -> None:
    assert values(TEXT, "odd", path='a "quoted" value') == [7.0]


def test_labels_of_an_info_gauge_are_its_payload() -> None:
    assert labels_of(TEXT, "vllm:cache_config_info") == [
        {"block_size": "16", "num_gpu_blocks": "29000"}
    ]


def test_a_malformed_line_ends_the_reading_with_what_came_before() -> None:
    assert totals('a 1\nb{x="1"} not-a-number\nc 2\n') == {"a": 1.0}
    assert totals("<html><body>502 Bad Gateway</body></html>") == {}


def test_values_of_one_family_are_read_past_a_malformed_line_of_another() -> None:
    text = 'b{x="1"} not-a-number\n' + TEXT
    assert values(text, "vllm:num_requests_running", engine="0") == [2.0]


def test_a_counter_sample_written_without_total_is_read_under_its_total_name() -> None:
    text = "# TYPE jobs counter\njobs 3.0\n# TYPE other gauge\nother 1.0\n"
    assert values(text, "jobs_total") == [3.0]


HISTOGRAM = """# HELP ratio Actual over predicted.
# TYPE ratio histogram
ratio_bucket{kind="stream",le="0.5"} 2.0
ratio_bucket{kind="stream",le="1.0"} 6.0
ratio_bucket{kind="stream",le="2.0"} 10.0
ratio_bucket{kind="stream",le="+Inf"} 10.0
ratio_count{kind="stream"} 10.0
ratio_sum{kind="stream"} 9.0
ratio_bucket{kind="whole",le="0.5"} 0.0
ratio_bucket{kind="whole",le="1.0"} 0.0
ratio_bucket{kind="whole",le="2.0"} 0.0
ratio_bucket{kind="whole",le="+Inf"} 0.0
ratio_count{kind="whole"} 0.0
ratio_sum{kind="whole"} 0.0
"""


def test_a_histogram_quantile_interpolates_within_its_bucket() -> None:
    # The 5th of 10 observations lies 3/4 of the way through the (0.5, 1.0] bucket.
    assert histogram_quantile(HISTOGRAM, "ratio", 0.5, kind="stream") == 0.875
    assert histogram_quantile(HISTOGRAM, "ratio", 0.9, kind="stream") == 1.75
    assert histogram_quantile(HISTOGRAM, "ratio", 0.5, kind="whole") is None
