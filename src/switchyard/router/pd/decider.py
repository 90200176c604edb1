"""Conditional disaggregation: skip the prefill pool when little of the prompt needs computing.

As llm-d's P/D decider: a short uncached remainder costs less to prefill on the decode
worker than a round trip through a prefill worker and a KV transfer. The uncached
remainder is the prompt minus the longest prefix a decode worker already holds (the KV
store's match, when the router has a store and it answered), else the prompt-length estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.balancer.worker import Worker
from switchyard.router.scheduler.framework import Context


@dataclass(slots=True)
class Decision:
    disaggregate: bool
    uncached_tokens: int
    source: str  # "kvstore", "estimate" or "always"


class Decider:
    def __init__(self, min_prefill_tokens: int) -> None:
        self.min_prefill_tokens = min_prefill_tokens

    def decide(self, ctx: Context, decode_workers: list[Worker]) -> Decision:
        """``ctx`` carries the prompt size and, if looked up, the decode workers' matches."""
        if self.min_prefill_tokens <= 0:
            return Decision(True, ctx.prompt_tokens, "always")
        uncached, source = ctx.prompt_tokens, "estimate"
        if ctx.prefix is not None and not ctx.prefix.degraded:
            best = max((ctx.matched.get(w.id, 0.0) for w in decode_workers), default=0.0)
            uncached, source = max(0, ctx.prompt_tokens - int(best)), "kvstore"
        return Decision(uncached >= self.min_prefill_tokens, uncached, source)
