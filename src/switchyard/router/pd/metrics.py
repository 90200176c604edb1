"""P/D metrics on the router's registry: TTFT by phase, pool load, paths, fallbacks, aborts."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Role
from switchyard.core.labels import LabelCache
from switchyard.router.metrics import RouterMetrics

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _PoolLoad(Collector):
    """Per-pool in-flight requests and routable workers, read from the fleet at scrape time."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "switchyard_router_pd_pool_inflight",
            "Requests in flight on each pool's workers, as counted by this router.",
            labels=["pool"],
        )
        workers = GaugeMetricFamily(
            "switchyard_router_pd_pool_workers",
            "Routable workers in each pool.",
            labels=["pool"],
        )
        for role in Role:
            members = [w for w in self.fleet.workers() if w.role == role]
            inflight.add_metric([str(role)], float(sum(w.local_inflight for w in members)))
            workers.add_metric([str(role)], float(len(self.fleet.candidates(None, role))))
        yield inflight
        yield workers


class PDMetrics(LabelCache):
    def __init__(self, metrics: RouterMetrics, fleet: FleetView) -> None:
        super().__init__()
        r = metrics.registry
        self.paths = Counter(
            "switchyard_router_pd_requests",
            "Requests taken by the P/D orchestrator, by protocol and path "
            "(disaggregated, direct = prefill skipped by the decider, fallback = whole request "
            "on a decode/unified worker after prefill failed).",
            ["protocol", "path"],
            registry=r,
        )
        self.phase = Histogram(
            "switchyard_router_pd_ttft_phase_seconds",
            "TTFT split as the router sees it: prefill (prefill leg answered), transfer "
            "(prefill answered to the decode response head, streams), decode_first_token "
            "(decode head to its first body chunk, streams), encode (encode leg).",
            ["protocol", "phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "switchyard_router_pd_decisions",
            "Conditional disaggregation verdicts (disaggregate or direct), by where the "
            "uncached prompt size came from (kvstore, estimate, or always when off).",
            ["verdict", "source"],
            registry=r,
        )
        self.fallbacks = Counter(
            "switchyard_router_pd_fallbacks",
            "Degraded paths taken, by reason.",
            ["reason"],
            registry=r,
        )
        self.aborts = Counter(
            "switchyard_router_pd_aborts",
            "Legs aborted because the other leg failed or timed out, by leg and reason.",
            ["leg", "reason"],
            registry=r,
        )
        self.leg_failures = Counter(
            "switchyard_router_pd_leg_failures",
            "Failed prefill/encode legs, by leg and reason.",
            ["leg", "reason"],
            registry=r,
        )
        metrics.register_live(_PoolLoad(fleet))
