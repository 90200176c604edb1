"""The scheduling cycle, in the style of kube-scheduler and the Gateway API Inference Extension.

A policy is one configuration of this cycle: filters drop candidates, weighted
scorers each rate every survivor in [0, 1], and a picker turns the combined
scores into a preference order. The order (not a single pick) lets the relay
fail over to the next-best worker without scheduling again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from switchyard.balancer.worker import Worker
    from switchyard.kvstore.store import LookupResult
    from switchyard.router.usage import Usage


@dataclass(slots=True)
class Explanation:
    """What one scheduling cycle looked at, kept only when asked (a traced request): the
    candidates it got, the workers the filters left, and each scorer's values for them."""

    candidates: int = 0
    workers: list[str] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class Context:
    """What a scheduling decision may look at; filled by the router before the cycle.

    ``matched`` maps a worker id to the prompt tokens it already holds (best rank,
    tier-weighted), from the KV store's lookup; empty when the policy needs none
    or the store had no information. ``cached_blocks`` is how much each worker
    holds in all (a recent snapshot), so new prefixes can go where they evict least.
    """

    model: str | None
    session_key: str | None = None
    # The LoRA adapter the request names as its model (a worker lists it with a parent).
    lora_name: str | None = None
    prompt_tokens: int = 0
    request_id: str = ""
    priority: str = "normal"
    prefix: LookupResult | None = None
    matched: dict[str, float] = field(default_factory=dict)
    matched_rank: dict[str, int] = field(default_factory=dict)
    cached_blocks: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    # (model, prompt-or-messages kwargs, cache salt, LoRA name) when full tokenization was
    # deferred.
    deferred_keys: tuple[str, dict[str, Any], str | None, str | None] | None = None
    # The engine's usage in the answer (None: it had none) and the tokens the relay counted.
    usage: Usage | None = None
    generated: int = 0
    # Filled by the cycle when set (``Explanation``); None on an untraced request.
    explain: Explanation | None = None

    def uncached(self, worker_id: str) -> int:
        """Prompt tokens this worker would have to prefill."""
        left = self.prompt_tokens - int(self.matched.get(worker_id, 0.0))
        return left if left > 0 else 0  # not max(): a keyword parse a call, on every request

    def set_prefix(self, prefix: LookupResult) -> None:
        self.prefix = prefix
        self.prompt_tokens = prefix.total_tokens if prefix.total_tokens > 1 else 1
        for m in prefix.matches:
            weighted = m.weighted_tokens
            if weighted > self.matched.get(m.instance, -1.0):
                self.matched[m.instance] = weighted
                self.matched_rank[m.instance] = m.dp_rank


class NoParams(BaseModel):
    """Options of a component that takes none: any option given to it is a mistake."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Filter(Protocol):
    name: str

    def filter(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        """Return the workers that may take this request."""


class Scorer(Protocol):
    name: str
    uses_prefix: bool

    def score(self, ctx: Context, workers: list[Worker]) -> list[float] | None:
        """One value in [0, 1] per worker, higher is better; None abstains (the request
        gives this scorer nothing to tell the workers apart by)."""


class Picker(Protocol):
    name: str
    uses_prefix: bool

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        """All workers, most preferred first."""


class Guard(Protocol):
    """Last word on an order: may demote the first choices (e.g. to bound load)."""

    def apply(self, ctx: Context, order: list[Worker]) -> list[Worker]:
        """The same workers, possibly reordered."""


@dataclass(slots=True)
class Scheduler:
    policy: str
    picker: Picker
    filters: Sequence[Filter] = ()
    scorers: Sequence[tuple[Scorer, float]] = ()
    guard: Guard | None = None

    @property
    def needs_prefix(self) -> bool:
        """Whether this policy wants the KV store's prefix matches before it runs."""
        return self.picker.uses_prefix or any(scorer.uses_prefix for scorer, _ in self.scorers)

    def schedule(self, ctx: Context, workers: list[Worker]) -> list[Worker]:
        explain = ctx.explain
        if explain is not None:
            explain.candidates = len(workers)
        for f in self.filters:
            workers = f.filter(ctx, workers)
            if not workers:
                return workers
        if explain is not None:
            explain.workers = [w.id for w in workers]
        order = self.picker.order(ctx, workers, self.combined_scores(ctx, workers))
        if self.guard is not None and len(order) > 1:
            order = self.guard.apply(ctx, order)
        return order

    def combined_scores(self, ctx: Context, workers: list[Worker]) -> list[float]:
        if not self.scorers:
            return [0.0] * len(workers)
        total = [0.0] * len(workers)
        weight_sum = 0.0
        for scorer, weight in self.scorers:
            values = scorer.score(ctx, workers)
            if values is None:
                # An abstaining scorer adds no weight: a constant would only compress the
                # others' differences, and a relative tie tolerance with them.
                continue
            weight_sum += weight
            if ctx.explain is not None:
                ctx.explain.scores[scorer.name] = values
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
        return [t / weight_sum for t in total] if weight_sum else total
