"""Filters: drop candidates that must not take the request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.scheduler.framework import Context

if TYPE_CHECKING:
    from balancer.worker import Worker


class MaxInflightFilter:
    """Keep workers below a hard in-flight cap (admission per worker)."""

    name = "max_inflight"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def filter(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        return [w for w in workers if w.inflight < self.limit]
