"""Prometheus metrics of one KV store (its own registry, so several stores can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from switchyard.core.labels import LabelCache


class KVStoreMetrics(LabelCache):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        r = self.registry = registry or CollectorRegistry()
        p = "switchyard_kvstore_"
        self.event_batches = Counter(
            p + "event_batches", "Event batches applied", ["instance"], registry=r
        )
        self.events = Counter(p + "events", "KV events applied (rate = events/s)", registry=r)
        self.blocks_stored = Counter(p + "blocks_stored", "Blocks indexed from events", registry=r)
        self.blocks_removed = Counter(p + "blocks_removed", "Blocks removed by events", registry=r)
        self.orphan_blocks = Counter(
            p + "orphan_blocks", "Stored blocks whose parent was never seen", registry=r
        )
        self.gaps = Counter(p + "sequence_gaps", "Sequence gaps detected", ["instance"], registry=r)
        self.replays = Counter(
            p + "replays", "Replay attempts after a gap", ["instance", "outcome"], registry=r
        )
        self.clears = Counter(
            p + "instance_clears", "Instance/rank clears", ["instance", "reason"], registry=r
        )
        self.decode_errors = Counter(p + "decode_errors", "Undecodable event frames", registry=r)
        # Under the router's --processes each process keeps its own store: its gauges show
        # one value (the largest) rather than one series per process.
        self.lag = Gauge(
            p + "event_lag_seconds",
            "Now minus the last batch timestamp",
            ["instance"],
            registry=r,
            multiprocess_mode="max",
        )
        self.index_blocks = Gauge(
            p + "index_blocks",
            "Indexed (block, location) entries",
            registry=r,
            multiprocess_mode="max",
        )
        # 1 from a publisher's connection found dead or lost until its feed resynced: the
        # router estimates that instance's cache from its placements meanwhile.
        self.feed_stale = Gauge(
            p + "feed_stale",
            "1 while an instance's event feed is down or not yet resynced",
            ["instance"],
            registry=r,
            multiprocess_mode="max",
        )
        self.feed_disconnects = Counter(
            p + "feed_disconnects",
            "Event-feed connections lost or dropped "
            "(reason: lost, silent, frame_too_large, protocol)",
            ["instance", "reason"],
            registry=r,
        )
        self.lookups = Counter(p + "lookups", "Lookups answered", ["outcome"], registry=r)
        self.lookup_seconds = Histogram(
            p + "lookup_seconds",
            "Lookup latency excluding tokenization",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            p + "tokenize_seconds",
            "Routing tokenization latency",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.degraded = Gauge(
            p + "degraded",
            "1 while the backend is unreachable",
            registry=r,
            multiprocess_mode="max",
        )
        self.degraded_incidents = Counter(
            p + "degraded_incidents", "Times the backend became unreachable", registry=r
        )
        self.backend_errors = Counter(
            p + "backend_errors", "Failed backend calls", ["op"], registry=r
        )
        self.resyncs = Counter(
            p + "resyncs",
            "Instances rewritten into the backend from their event state after an outage",
            ["instance"],
            registry=r,
        )
