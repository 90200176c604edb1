"""Scorers: rate each candidate in [0, 1], higher is better."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.scheduler.framework import Context

if TYPE_CHECKING:
    from balancer.worker import Worker


class InflightScorer:
    """Fewer router-side in-flight requests is better (exact and instant)."""

    name = "load"

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        loads = [w.inflight for w in workers]
        top = max(loads) + 1
        return [1.0 - load / top for load in loads]
