"""The scheduling cycle, in the style of kube-scheduler and the Gateway API Inference Extension.

A policy is one configuration of this cycle: filters drop candidates, weighted
scorers each rate every survivor in [0, 1], and a picker turns the combined
scores into a preference order. The order (not a single pick) lets the relay
fail over to the next-best worker without scheduling again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from balancer.worker import Worker


@dataclass(slots=True)
class Context:
    """What a scheduling decision may look at; filled by the router before the cycle."""

    model: str | None
    session_key: str | None = None
    prompt_tokens: int = 0
    request_id: str = ""
    attrs: dict[str, object] = field(default_factory=dict)


class Filter(Protocol):
    name: str

    def filter(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        """Return the workers that may take this request."""


class Scorer(Protocol):
    name: str

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        """One value in [0, 1] per worker, higher is better."""


class Picker(Protocol):
    name: str

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        """All workers, most preferred first."""


@dataclass(slots=True)
class Scheduler:
    policy: str
    picker: Picker
    filters: Sequence[Filter] = ()
    scorers: Sequence[tuple[Scorer, float]] = ()

    def schedule(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        for f in self.filters:
            workers = f.filter(ctx, workers)
            if not workers:
                return workers
        return self.picker.order(ctx, workers, self.combined_scores(ctx, workers))

    def combined_scores(self, ctx: Context, workers: list[Worker]) -> list[float]:
        if not self.scorers:
            return [0.0] * len(workers)
        total = [0.0] * len(workers)
        weight_sum = 0.0
        for scorer, weight in self.scorers:
            weight_sum += weight
            for i, value in enumerate(scorer.score(ctx, workers)):
                total[i] += weight * value
        return [t / weight_sum for t in total] if weight_sum else total
