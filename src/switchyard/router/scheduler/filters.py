"""Filters: drop candidates that must not take the request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from switchyard.router.scheduler.framework import Context

if TYPE_CHECKING:
    from switchyard.balancer.worker import Worker


class MaxInflightFilter:
    """Keep workers below a hard in-flight cap (admission per worker)."""

    name = "max_inflight"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        limit: int = Field(ge=1, description="in-flight requests a worker may hold")

    def __init__(self, params: Params) -> None:
        self.limit = params.limit

    def filter(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        return [w for w in workers if w.inflight < self.limit]
