"""Labelled metric children, cached: prometheus_client's ``labels()`` takes a lock and
builds a key on every call, a cost paid on every request where it sits on the hot path."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram


class LabelCache:
    """Labelled children, cached: ``labels()`` takes a lock and builds a key every call."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
