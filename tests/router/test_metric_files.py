"""Under ``--processes``, each process's metrics are written to its files behind their values."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from switchyard.loadtest.prom import values as sample_values
from switchyard.router.metrics import (
    FLUSH_INTERVAL_S,
    flush_metric_files,
    flush_metric_files_on,
)
from tests.support import eventually_async


def summed(directory: Path, name: str, **labels: str) -> float:
    """What a /metrics over the directory's files shows for one sample."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return sum(sample_values(generate_latest(registry).decode(), name, **labels))


def test_an_increment_reaches_the_files_at_the_next_flush(metric_dir: Path) -> None:
    counter = Counter("sy_test_requests", "test", ["status"], registry=None)
    counter.labels("200").inc()
    counter.labels("200").inc(2)
    assert summed(metric_dir, "sy_test_requests_total", status="200") == 0
    flush_metric_files()
    assert summed(metric_dir, "sy_test_requests_total", status="200") == 3


def test_the_value_is_read_in_process_before_any_flush(metric_dir: Path) -> None:
    counter = Counter("sy_test_local", "test", registry=None)
    counter.inc(5)
    assert counter._value.get() == 5


def test_histograms_and_gauges_are_written_behind_alike(metric_dir: Path) -> None:
    histogram = Histogram("sy_test_seconds", "test", buckets=(0.1, 1.0), registry=None)
    gauge = Gauge("sy_test_level", "test", multiprocess_mode="max", registry=None)
    histogram.observe(0.5)
    gauge.set(7)
    flush_metric_files()
    assert summed(metric_dir, "sy_test_seconds_bucket", le="1.0") == 1
    assert summed(metric_dir, "sy_test_seconds_count") == 1
    assert summed(metric_dir, "sy_test_level") == 7


def test_a_value_changed_again_after_a_flush_is_written_again(metric_dir: Path) -> None:
    counter = Counter("sy_test_again", "test", registry=None)
    counter.inc()
    flush_metric_files()
    counter.inc()
    flush_metric_files()
    assert summed(metric_dir, "sy_test_again_total") == 2


async def test_a_change_is_written_within_the_interval_once_a_loop_flushes(
    metric_dir: Path,
) -> None:
    counter = Counter("sy_test_timed", "test", registry=None)
    flush_metric_files_on(asyncio.get_running_loop())
    counter.inc()
    assert summed(metric_dir, "sy_test_timed_total") == 0
    # No flush is called: the loop writes the change on its own, within the interval.
    await asyncio.sleep(FLUSH_INTERVAL_S * 2)
    assert summed(metric_dir, "sy_test_timed_total") == 1


async def test_changes_after_a_flush_schedule_the_next_one(metric_dir: Path) -> None:
    counter = Counter("sy_test_next", "test", registry=None)
    flush_metric_files_on(asyncio.get_running_loop())
    counter.inc()
    await eventually_async(lambda: summed(metric_dir, "sy_test_next_total") == 1)
    counter.inc()
    assert await eventually_async(lambda: summed(metric_dir, "sy_test_next_total") == 2)


async def test_handing_over_the_loop_writes_what_changed_before(metric_dir: Path) -> None:
    counter = Counter("sy_test_before", "test", registry=None)
    counter.inc()
    flush_metric_files_on(asyncio.get_running_loop())
    assert summed(metric_dir, "sy_test_before_total") == 1
