"""Router metrics in Prometheus form, on a registry of its own (one per app instance).

Every metric the router defines lives here; P/D's own live in ``router.pd.metrics``
and the fleet's gauges are collected at scrape time by ``router.control``.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)
_SCHEDULE_BUCKETS = (
    0.0002,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    1,
    5,
)


# prometheus_client's multiprocess mode: set (by the supervisor of several router processes),
# every metric writes its samples to files in this directory, summed on each /metrics.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def pin_process_id() -> None:
    """Make this process's multiprocess-mode metrics name their file by the pid it has now.

    prometheus_client asks ``os.getpid()`` on every increment, to notice a fork; a router
    process never forks once it serves. That call was 7% of two router processes' CPU
    (py-spy, 2026-12-03, wrk against nginx): a getpid system call each time, about ten a
    request. Call before any metric is made."""
    pid = os.getpid()
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)  # type: ignore[no-untyped-call]


class LabelCache:
    """Labelled children, cached: ``labels()`` takes a lock and builds a key every call."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


class RouterMetrics(LabelCache):
    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        # Collectors that read this process's live state at scrape time. Under --processes
        # the summed /metrics is built from the processes' metric files, which hold none of
        # these: it adds them from the answering process.
        self.live: list[Collector] = []
        r = self.registry
        self.requests = Counter(
            "switchyard_router_requests",
            "Requests answered, by route, status and worker ('none' if answered by the router).",
            ["route", "status", "worker"],
            registry=r,
        )
        self.latency = Histogram(
            "switchyard_router_request_duration_seconds",
            "End-to-end latency seen by the router, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "switchyard_router_time_to_first_byte_seconds",
            "Time from request arrival to the first upstream body byte (TTFT for streams).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.schedule = Histogram(
            "switchyard_router_schedule_seconds",
            "Time to choose a worker: tokenization, KV lookup, scoring and admission; by "
            "turn: 'first' (a chat with no assistant message yet), 'later' (one with "
            "earlier answers, whose history the router has mostly seen), 'prompt' (no chat).",
            ["turn"],
            buckets=_SCHEDULE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "switchyard_router_retries",
            "Attempts retried on another worker, by reason.",
            ["reason"],
            registry=r,
        )
        self.decisions = Counter(
            "switchyard_router_routing_decisions",
            "First-choice routing decisions, by policy and worker.",
            ["policy", "worker"],
            registry=r,
        )
        self.decision_reasons = Counter(
            "switchyard_router_decision_reasons",
            "Why the first choice won: prefix, load, guard, cache_hit, cache_miss, imbalanced.",
            ["policy", "reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "switchyard_router_client_disconnects",
            "Client disconnects that aborted the upstream request.",
            registry=r,
        )
        self.admission = Counter(
            "switchyard_router_admission",
            "SLO admission outcomes: admitted, admitted_after_wait, rejected.",
            ["outcome", "priority"],
            registry=r,
        )
        self.ttft_prediction = Histogram(
            "switchyard_router_ttft_prediction_ratio",
            "Actual over predicted time to first byte of the chosen worker, by kind (stream: "
            "first token; whole: a non-streamed answer). 1 is a perfect prediction.",
            ["kind"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )

    def register_live(self, collector: Collector) -> None:
        """Serve ``collector`` on /metrics, also when several processes sum their metrics."""
        self.registry.register(collector)
        self.live.append(collector)


class KVMetrics:
    """KV-aware routing's predicted vs actual cache hits; registered only with a KV store."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = Counter(
            "switchyard_router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen worker to have cached.",
            registry=registry,
        )
        self.actual = Counter(
            "switchyard_router_actual_cached_tokens",
            "Prompt tokens the engines reported as cached (usage.prompt_tokens_details).",
            registry=registry,
        )
        self.prompt = Counter(
            "switchyard_router_prompt_tokens",
            "Prompt tokens of answered requests that reported usage.",
            registry=registry,
        )
        self.degraded = Counter(
            "switchyard_router_kv_lookups_degraded",
            "Lookups answered without information (KV store down or slow).",
            registry=registry,
        )
        self.tokenize_cache = Counter(
            "switchyard_router_tokenize_cache",
            "Routing tokenization cache lookups by kind (message: a chat message's ids; piece: "
            "a cut of text; engine: an engine /tokenize answer) and outcome (hit, miss).",
            ["kind", "outcome"],
            registry=registry,
        )
        key_cache = Counter(
            "switchyard_router_block_key_cache",
            "Prompt blocks whose keys came from the block-key cache (hit) or were hashed (miss).",
            ["outcome"],
            registry=registry,
        )
        self.key_cache_hit = key_cache.labels("hit")
        self.key_cache_miss = key_cache.labels("miss")
