"""Router metrics in Prometheus form, on a registry of its own (one per app instance).

Every metric the router defines lives here; P/D's own live in ``router.pd.metrics``
and the fleet's gauges are collected at scrape time by ``router.control``.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.registry import Collector

from switchyard.core.labels import LabelCache

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


# How late a process's metric files may be: a sample written behind is on every process's
# /metrics within this time (the answering process's own samples at once).
FLUSH_INTERVAL_S = 0.1


class _Behind:
    """This process's samples changed since they were last written, and the loop that
    writes them (``write_metrics_behind``)."""

    dirty: list[Any] = []
    loop: asyncio.AbstractEventLoop | None = None


def write_metrics_behind() -> None:
    """Make this process's multiprocess-mode metrics write their files behind their values.

    prometheus_client's own multiprocess value writes its file (an mmap) on every increment,
    under a lock, after asking ``os.getpid()`` (a system call) to notice a fork: many
    writes a request here, a sizeable share of a router's CPU for the pid calls, the
    writes and the lock (``docs/decisions/0005-metrics-write-behind.md``). A router
    process never forks once it serves, and its metrics change on its event loop only: each
    value now changes in memory and is written by ``flush_metric_files``: within
    ``FLUSH_INTERVAL_S`` of the first change since the last write (a timer on the loop
    given to ``flush_metric_files_on``, none while nothing changes), and before the process
    answers /metrics. Call before any metric is made."""
    pid = os.getpid()
    files: dict[str, MmapedDict] = {}
    directory = os.environ[METRICS_DIR_ENV]
    dirty = _Behind.dirty

    class WrittenBehindValue:
        _multiprocess = True

        __slots__ = ("_file", "_key", "_value", "_timestamp", "_dirty")

        def __init__(
            self,
            typ: str,
            metric_name: str,
            name: str,
            labelnames: Any,
            labelvalues: Any,
            help_text: str,
            multiprocess_mode: str = "",
            **kwargs: Any,
        ) -> None:
            prefix = f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ
            file = files.get(prefix)
            if file is None:
                path = os.path.join(directory, f"{prefix}_{pid}.db")
                file = files[prefix] = MmapedDict(path)  # type: ignore[no-untyped-call]
            self._file = file
            self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
            self._value, self._timestamp = file.read_value(self._key)  # type: ignore[no-untyped-call]
            self._dirty = False

        def inc(self, amount: float) -> None:
            self._value += amount
            if not self._dirty:
                self._changed()

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0
            if not self._dirty:
                self._changed()

        def _changed(self) -> None:
            self._dirty = True
            dirty.append(self)
            if len(dirty) == 1 and _Behind.loop is not None:
                _Behind.loop.call_later(FLUSH_INTERVAL_S, flush_metric_files)

        def set_exemplar(self, exemplar: Any) -> None:
            return None  # multiprocess mode has no exemplars

        def get(self) -> float:
            return float(self._value)

        def get_exemplar(self) -> None:
            return None

        def write(self) -> None:
            self._dirty = False
            self._file.write_value(self._key, self._value, self._timestamp)  # type: ignore[no-untyped-call]

    values.ValueClass = WrittenBehindValue


def flush_metric_files() -> None:
    """Write the samples changed since the last flush to this process's metric files."""
    dirty = _Behind.dirty
    if dirty:
        batch = dirty[:]
        dirty.clear()
        for value in batch:
            value.write()


def flush_metric_files_on(loop: asyncio.AbstractEventLoop | None) -> None:
    """Write changed samples from timers on ``loop`` (None: only when flushed by hand)."""
    flush_metric_files()
    _Behind.loop = loop


class RouterMetrics(LabelCache):
    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        # Collectors that read this process's live state at scrape time. Under --processes
        # the summed /metrics is built from the processes' metric files, which hold none of
        # these: it adds them from the answering process.
        self.live: list[Collector] = []
        # Run before each /metrics: bring counters kept outside the registry up to date.
        self.before_scrape: list[Callable[[], None]] = []
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
        self.migrations = Counter(
            "switchyard_router_migrations",
            "Streams whose worker failed after the first byte, by reason (cut, error_event, "
            "stall) and outcome (resumed on another worker, failed there, not_allowed: the "
            "request or its limits forbid it, so it ended with an error event).",
            ["reason", "outcome"],
            registry=r,
        )
        self.migrated_tokens = Counter(
            "switchyard_router_migrated_tokens",
            "Prompt and generated tokens carried to the workers that resumed streams.",
            registry=r,
        )
        self.migration_resume = Histogram(
            "switchyard_router_migration_resume_seconds",
            "Time from a stream's failure to its first chunk from the worker resuming it.",
            buckets=_LATENCY_BUCKETS,
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
            "a cut of text; engine: an engine /tokenize answer; conversation: a chat found as "
            "the extension of one seen before) and outcome (hit, miss).",
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
        self.conversations = Gauge(
            "switchyard_router_conversation_lines",
            "Conversations whose tokenized prefix and block keys the router keeps to extend.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.conversation_bytes = Gauge(
            "switchyard_router_conversation_bytes",
            "Memory those conversation lines take, estimated (bounded per tokenizer).",
            registry=registry,
            multiprocess_mode="livesum",
        )


# Flow control's tenant label: at most this many tenants have their own at a time, the rest
# share OTHER_TENANT, so a trusted header's values cannot grow the label set without bound.
# The labels go to the tenants served the most tokens lately, not to the first seen, so a
# burst of tenants early (health checks, a test key) does not keep a heavier tenant that
# comes later under OTHER_TENANT.
MAX_TENANT_LABELS = 20
OTHER_TENANT = "other"
# A tenant's served tokens count half after this long in its rank: minutes, so the labels
# follow who is served now, yet stay put across the scrapes of a dashboard's window.
TENANT_RANK_HALF_LIFE_S = 300.0
# A tenant takes the label of the lightest labelled one only with more than this many
# times its decayed tokens, so two tenants of like traffic do not swap the label back and forth.
TENANT_RANK_MARGIN = 1.5
# Tenants whose traffic is followed beyond the labelled ones: past twice this many the
# lightest are forgotten, so a flood of tenant names costs bounded memory.
_RANKED_TENANTS = 8 * MAX_TENANT_LABELS
_RESCALE_HALF_LIVES = 30.0
_TOKEN_KINDS = ("prompt", "output")
FLOW_OUTCOMES = (
    "dispatched",
    "queue_full",
    "queue_timeout",
    "shed",
    "rate_limited",
    "client_gone",
    "shutdown",
)


def band_label(priority: int) -> str:
    """A priority band's label, clamped to -10..10 (a client's integer is not a label)."""
    return str(min(max(priority, -10), 10))


class FlowMetrics:
    """Flow control's metrics on the router's registry; the queue's sizes and the saturated
    models are read at scrape time (``watch``), so waiting costs nothing to count.

    The tenant label: the first ``MAX_TENANT_LABELS`` tenants seen take one each; after
    that a tenant takes one from the labelled tenant with the fewest served tokens lately
    (prompt and output, halving every ``TENANT_RANK_HALF_LIFE_S``) once it has more than
    ``TENANT_RANK_MARGIN`` times as many, ranked in ``flush_served`` so that ``served``
    stays a dict update. A tenant's own series counts from when it took the label; before
    that and after it loses the label, its tokens count under ``OTHER_TENANT``.

    The evicted tenant's ``served_tokens`` series are removed, so a scrape shows at most
    ``MAX_TENANT_LABELS`` tenants and ``OTHER_TENANT``; should it take a label again, its
    series starts again from zero, which ``rate()`` reads as a counter reset. Under
    ``--processes`` (``METRICS_DIR_ENV``) no series can be removed, since each process's
    samples live in its metric files, which prometheus_client cannot delete from and which
    every /metrics sums as they stand: there the evicted tenant's series stays at its last
    value, and so a process lets at most twice ``MAX_TENANT_LABELS`` tenants ever take a
    label, after which only those take one back (resuming their series). Each process
    ranks the traffic it served, so the summed /metrics carries the union of the
    processes' labels, the same tenants while each tenant's requests spread over them.
    """

    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        r = metrics.registry
        self._router = metrics
        self._clock = clock
        self._labelled: set[str] = set()
        # Decayed tokens served per tenant, in units that grow by 2x every half-life from
        # ``_origin`` (so decay needs no pass over them): comparable as they stand.
        self._scores: dict[str, float] = {}
        self._origin = clock()
        # The served_tokens children by (tenant label, kind); under --processes also of the
        # evicted tenants, whose samples stay in the files.
        self._counters: dict[tuple[str, str], Any] = {}
        self._ever_labelled: set[str] = set()  # under --processes only
        self.outcomes = Counter(
            "switchyard_router_flow_outcomes",
            "Flow control's answers to requests that did not pass straight through: "
            "dispatched (from the queue), queue_full, queue_timeout, shed, rate_limited, "
            "client_gone (left while queued), shutdown.",
            ["outcome"],
            registry=r,
        )
        self._outcomes = {name: self.outcomes.labels(name) for name in FLOW_OUTCOMES}
        self.wait = Histogram(
            "switchyard_router_flow_queue_wait_seconds",
            "Time dispatched requests waited in the router's queue, by priority band.",
            ["band"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.served_tokens = Counter(
            "switchyard_router_flow_served_tokens",
            "Tokens served per tenant (the fair share's input), by kind: prompt or output. "
            "The tenants served the most tokens lately have their own tenant label, the "
            "rest share 'other', so that the series stay few.",
            ["tenant", "kind"],
            registry=r,
        )
        self._served: dict[str, list[int]] = {}
        self._settle: Callable[[], None] | None = None
        self._files = METRICS_DIR_ENV in os.environ
        metrics.before_scrape.append(self.flush_served)

    def tenant_label(self, tenant: str) -> str:
        """The tenant's label now: its own while it holds one, else ``OTHER_TENANT``. A
        tenant seen while fewer than ``MAX_TENANT_LABELS`` hold one takes one at once."""
        if tenant in self._labelled:
            return tenant
        if len(self._labelled) < MAX_TENANT_LABELS and self._may_label(tenant):
            self._grant(tenant)
            return tenant
        return OTHER_TENANT

    def _may_label(self, tenant: str) -> bool:
        if tenant == OTHER_TENANT:  # its own label would be the shared series
            return False
        if not self._files:
            return True
        return tenant in self._ever_labelled or len(self._ever_labelled) < 2 * MAX_TENANT_LABELS

    def _grant(self, tenant: str) -> None:
        self._labelled.add(tenant)
        if self._files:
            self._ever_labelled.add(tenant)

    def _evict(self, tenant: str) -> None:
        self._labelled.discard(tenant)
        if self._files:
            return  # its samples stay in the files; its children resume if it comes back
        for kind in _TOKEN_KINDS:
            if self._counters.pop((tenant, kind), None) is not None:
                self.served_tokens.remove(tenant, kind)

    def _scale(self, now: float) -> float:
        """Score units per token at ``now``; rescales the scores when it has grown large."""
        exponent = (now - self._origin) / TENANT_RANK_HALF_LIFE_S
        if exponent <= _RESCALE_HALF_LIVES:
            return math.exp2(exponent)
        factor = math.exp2(exponent)
        self._origin = now
        self._scores = {
            tenant: score / factor
            for tenant, score in self._scores.items()
            if score >= factor or tenant in self._labelled  # forgotten below a token
        }
        return 1.0

    def _rank(self, tenants: Iterable[str]) -> None:
        """Give labels to the heaviest of ``tenants`` (those just served) that have none:
        a free one, or the lightest labelled tenant's when outweighing it by the margin.
        Decay keeps the order of the others, so only those just served can move up."""
        scores = self._scores
        candidates = sorted(
            (t for t in tenants if t not in self._labelled),
            key=scores.__getitem__,
            reverse=True,
        )
        for tenant in candidates:
            if not self._may_label(tenant):
                continue
            if len(self._labelled) < MAX_TENANT_LABELS:
                self._grant(tenant)
                continue
            lightest = min(self._labelled, key=lambda t: scores.get(t, 0.0))
            if scores[tenant] <= scores.get(lightest, 0.0) * TENANT_RANK_MARGIN:
                break  # the rest are lighter still
            self._evict(lightest)
            self._grant(tenant)
        if len(scores) > 2 * _RANKED_TENANTS:
            others = (t for t in scores if t not in self._labelled)
            kept = heapq.nlargest(_RANKED_TENANTS, others, key=scores.__getitem__)
            self._scores = {t: scores[t] for t in (*kept, *self._labelled) if t in scores}

    def outcome(self, name: str) -> None:
        self._outcomes[name].inc()

    def dispatched(self, priority: int, waited_s: float) -> None:
        self._outcomes["dispatched"].inc()
        self._router.child(self.wait, band_label(priority)).observe(waited_s)

    def served(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count an answer's tokens: in a plain dict here, into the counter before a scrape
        (``flush_served``), since a counter's increment is several times the cost."""
        pending = self._served.get(tenant)
        if pending is None:
            if self._files and not self._served:  # the other processes read the files
                asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, self.flush_served)
            self._served[tenant] = [prompt_tokens, output_tokens]
        else:
            pending[0] += prompt_tokens
            pending[1] += output_tokens

    def flush_served(self) -> None:
        """Rank the tenants with the tokens counted since the last flush, then count those
        into the counter under the labels that ranking left."""
        if self._settle is not None:
            self._settle()
        served, self._served = self._served, {}
        if not served:
            return
        scale = self._scale(self._clock())
        scores = self._scores
        for tenant, (prompt_tokens, output_tokens) in served.items():
            scores[tenant] = scores.get(tenant, 0.0) + (prompt_tokens + output_tokens) * scale
        self._rank(served)
        counters = self._counters
        for tenant, tokens in served.items():
            label = tenant if tenant in self._labelled else OTHER_TENANT
            for kind, count in zip(_TOKEN_KINDS, tokens, strict=True):
                if count:
                    counter = counters.get((label, kind))
                    if counter is None:
                        counter = counters[label, kind] = self.served_tokens.labels(label, kind)
                    counter.inc(count)

    def watch(
        self,
        sizes: Callable[[], dict[tuple[int, str], int]],
        saturated_models: Callable[[], list[str]],
        settle: Callable[[], None] | None = None,
    ) -> None:
        """Serve the queue's sizes and the saturated models as gauges, read at scrape time;
        ``settle`` hands over the tokens served but not yet counted, before each flush."""
        self._router.register_live(_FlowGauges(self, sizes, saturated_models))
        self._settle = settle


class _FlowGauges(Collector):
    def __init__(
        self,
        owner: FlowMetrics,
        sizes: Callable[[], dict[tuple[int, str], int]],
        saturated_models: Callable[[], list[str]],
    ) -> None:
        self.owner = owner
        self.sizes = sizes
        self.saturated_models = saturated_models

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "switchyard_router_flow_queued",
            "Requests waiting in the router's queue, by priority band and tenant (the "
            "tenants served the most tokens lately by name, the rest as 'other').",
            labels=["band", "tenant"],
        )
        totals: dict[tuple[str, str], int] = {}
        for (priority, tenant), count in self.sizes().items():
            key = (band_label(priority), self.owner.tenant_label(tenant))
            totals[key] = totals.get(key, 0) + count
        for (band, tenant), count in sorted(totals.items()):
            queued.add_metric([band, tenant], count)
        yield queued
        saturated = GaugeMetricFamily(
            "switchyard_router_flow_saturated_models",
            "1 for each model whose every candidate worker is saturated now.",
            labels=["model"],
        )
        for model in self.saturated_models():
            saturated.add_metric([model], 1)
        yield saturated
