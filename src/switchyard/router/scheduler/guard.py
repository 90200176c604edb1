"""The hot-spot guard: bounded load on top of any policy.

Cache affinity left alone concentrates traffic: one engine holds the hot prefix,
every request goes there, its queue grows, its cache churns (the cache-aware
"death spiral" the peers' users report). The guard demotes any worker that would
go above (1 + epsilon) x the mean in-flight load (plus a small absolute slack so
light traffic keeps its affinity) while some candidate stays within the bound.
The defaults (0.5, 4) held the multi-turn demo workload near its hit-rate ceiling,
where a tighter bound cost hit rate and no guard cost both hit rate and an even spread
(``bench.compare_routing multiturn``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from switchyard.router.scheduler.framework import Context

if TYPE_CHECKING:
    from switchyard.balancer.worker import Worker


class BoundedLoadGuard:
    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        epsilon: float = Field(default=0.5, ge=0, description="allowed excess over the mean load")
        slack: float = Field(default=4.0, ge=0, description="absolute in-flight slack")

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self.epsilon = p.epsilon
        self.slack = p.slack

    def capacity(self, workers: list[Worker]) -> float:
        mean_after = (sum([w.inflight for w in workers]) + 1) / len(workers)
        return (1.0 + self.epsilon) * mean_after + self.slack

    def apply(self, ctx: Context, order: list[Worker]) -> list[Worker]:
        cap = self.capacity(order)
        if order[0].inflight + 1 <= cap:
            return order
        fits = [w for w in order if w.inflight + 1 <= cap]
        if not fits:
            return order
        ctx.reason = "guard"
        return fits + [w for w in order if w.inflight + 1 > cap]
