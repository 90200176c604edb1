"""Scorers: rate each candidate in [0, 1], higher is better."""

from __future__ import annotations

import statistics
from itertools import repeat
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict, Field

from switchyard.router.scheduler.framework import Context, NoParams
from switchyard.router.scheduler.session import session_ranking

if TYPE_CHECKING:
    from switchyard.balancer.worker import Worker


class InflightScorer:
    """Fewer router-side in-flight requests is better (exact and instant)."""

    name = "load"
    uses_prefix = False
    Params = NoParams

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        loads = [w.inflight for w in workers]
        top = max(loads) + 1
        return [1.0 - load / top for load in loads]


class PrefixCacheScorer:
    """Share of the prompt the worker already holds in its KV cache (from the KV store)."""

    name = "prefix_cache"
    uses_prefix = True
    Params = NoParams

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        total = max(ctx.prompt_tokens, 1)
        return [min(ctx.matched.get(w.id, 0.0) / total, 1.0) for w in workers]


class KVAwareScorer:
    """Predicted work to serve the request here, in KV blocks (after Dynamo's KV router).

    cost = prefill_weight x (uncached prompt blocks + queued prefill blocks)
           + decode_weight x active decode blocks
           + occupancy_weight x tenths of the fullest cache this worker fills
           + replication_weight x blocks of the best holder's prefix this worker lacks
    A worker that already holds the prefix skips that prefill; one busy decoding long
    contexts pays for every step it shares. Decode blocks weigh less than prefill
    blocks by default: attending a cached token in a decode step is far cheaper than
    computing one (0.04 vs 17 us per token in the mock's H100 fit), but they also hold
    KV memory that a new prefix would have to evict. The small occupancy term sends a
    prefix nobody holds to the emptiest cache (SGLang's "smallest tree"), so distinct
    hot prefixes land on distinct workers instead of evicting each other. Sending a
    request away from the worker that holds most of its prefix copies that prefix: the
    copy evicts other prefixes and the next turn of the conversation finds two half-warm
    workers instead of one warm one. Its weight (10 blocks per block copied) is measured,
    not derived: a copy cost lifted the hit rate on the Mooncake trace and under
    saturation, with a lower TTFT p90 (``bench.compare_routing``), and this weight did
    best over several windows of the trace in ``switchyard simulate`` (see
    docs/benchmarks.md). Scores are min-cost relative: the cheapest worker gets 1.0, one twice as
    expensive about 0.5.
    """

    name = "kv_aware"
    uses_prefix = True

    class Params(BaseModel):
        """The cost weights, in KV blocks of cost; the one place their defaults live."""

        model_config = ConfigDict(extra="forbid", frozen=True)

        prefill_weight: float = Field(
            default=1.0, ge=0, description="per uncached or queued prefill block"
        )
        decode_weight: float = Field(default=0.25, ge=0, description="per active decode block")
        occupancy_weight: float = Field(
            default=1.0, ge=0, description="per tenth of the fullest cache this worker fills"
        )
        replication_weight: float = Field(
            default=10.0, ge=0, description="per block of the best holder's prefix this lacks"
        )

    def __init__(self, params: Params | None = None, *, block_size: int) -> None:
        p = params or self.Params()
        self.prefill_weight = p.prefill_weight
        self.decode_weight = p.decode_weight
        self.occupancy_weight = p.occupancy_weight
        self.replication_weight = p.replication_weight
        # Costs count blocks of the lookup's size; this one serves when no lookup ran.
        self.block_size = block_size

    def costs(
        self, ctx: Context, workers: list[Worker], factors: list[float] | None = None
    ) -> list[float]:
        """The cost of each worker; ``factors`` (one per worker) scale its own work, the
        prefill and decode terms (``LatencyScorer``'s speeds)."""
        bs = ctx.prefix.block_size if ctx.prefix is not None else self.block_size
        # One pass per input over the candidates, no per-worker function calls besides
        # load(): over a thousand workers this loop is most of a simulated decision. The
        # arithmetic is the cost formula above, term for term.
        matched = ctx.matched
        m = [matched.get(w.id, 0.0) for w in workers] if matched else [0.0] * len(workers)
        best_match = max(m, default=0.0)
        tenths = self._tenths(ctx, workers, best_match)
        pw, dw = self.prefill_weight, self.decode_weight
        ow, rw = self.occupancy_weight, self.replication_weight
        total = ctx.prompt_tokens
        scale = repeat(1.0) if factors is None else factors
        out = []
        for w, mi, tn, f in zip(workers, m, tenths, scale, strict=False):
            prefill, decode = w.queued_tokens()
            uncached = total - mi
            if not uncached > 0.0:
                uncached = 0.0
            out.append(
                f * (pw * ((uncached + prefill) / bs) + dw * (decode / bs))
                + ow * tn
                + rw * (best_match - mi) / bs
            )
        return out

    @staticmethod
    def _tenths(ctx: Context, workers: list[Worker], best_match: float) -> list[int]:
        """Occupancy in tenths of the fullest cache: full caches that differ by a block or
        two are equal, an empty cache beats a full one by ten steps. It only matters
        where some worker holds part of the prompt; without reuse anywhere it would skew
        request counts for nothing."""
        if best_match > 0 and ctx.cached_blocks:
            cached = ctx.cached_blocks
            blocks = [cached.get(w.id, 0) for w in workers]
            fullest = max(blocks, default=0)
            if fullest:
                return [int(10 * b / fullest) for b in blocks]
        return [0] * len(workers)

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        costs = self.costs(ctx, workers)
        best = min(costs)
        return [(best + 1.0) / (c + 1.0) for c in costs]


class PrefillSpeeds(Protocol):
    """Each worker's learned seconds per prefill token (the router's TTFT model)."""

    def prefill_s_per_token(self, worker_id: str) -> float | None:
        """The worker's own learned rate; None until it has answered."""


class LatencyScorer(KVAwareScorer):
    """Predicted time to first token here: ``kv_aware``'s cost with each worker's work
    priced at its own learned prefill speed.

    The prefill and decode terms are work this worker must do before the request's first
    token, so they are scaled by its seconds per prefill token over the candidates'
    median: a worker half as fast costs twice as much for the same queue. The cache
    terms (occupancy, replication) are about the fleet's caches, not this worker's
    speed, and stay at the median's price. Speeds within ``dead_band`` of the median
    count as the median, so on equal engines the learned rates' noise changes nothing
    and the policy decides as ``kv_aware``. Until some worker has answered, every speed
    is the median.
    """

    name = "latency"
    uses_prefix = True

    class Params(KVAwareScorer.Params):
        dead_band: float = Field(
            default=0.2,
            ge=0,
            description="relative speed difference to the median treated as none",
        )

    def __init__(self, params: Params | None = None, *, block_size: int) -> None:
        p = params or self.Params()
        super().__init__(p, block_size=block_size)
        self.dead_band = p.dead_band
        # Bound by the router once its TTFT model exists (``RouterApp``); None: equal speeds.
        self.speeds: PrefillSpeeds | None = None

    def factors(self, workers: list[Worker]) -> list[float]:
        """Each worker's prefill time per token over the candidates' median (1 if unknown)."""
        speeds = self.speeds
        if speeds is None:
            return [1.0] * len(workers)
        rates = [speeds.prefill_s_per_token(w.id) for w in workers]
        known = [r for r in rates if r]
        if not known:
            return [1.0] * len(workers)
        median = statistics.median(known)
        band = self.dead_band
        out = []
        for r in rates:
            f = r / median if r else 1.0
            out.append(1.0 if abs(f - 1.0) <= band else f)
        return out

    def costs(
        self, ctx: Context, workers: list[Worker], factors: list[float] | None = None
    ) -> list[float]:
        if factors is None:
            factors = self.factors(workers)
        return super().costs(ctx, workers, None if all(f == 1.0 for f in factors) else factors)


class KVPressureScorer:
    """Free KV cache on the engine (scraped), so new prefixes land where they fit."""

    name = "kv_pressure"
    uses_prefix = False
    Params = NoParams

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        out = []
        for w in workers:
            usage = w.load().kv_usage
            out.append(1.0 - min(max(usage, 0.0), 1.0) if usage is not None else 0.5)
        return out


class QueueScorer:
    """Fewer requests waiting in the engine's queue (scraped) is better."""

    name = "queue"
    uses_prefix = False
    Params = NoParams

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        waiting = [w.load().engine_waiting or 0 for w in workers]
        top = max(waiting) + 1
        return [1.0 - q / top for q in waiting]


class LoraAffinityScorer:
    """Where the request's LoRA adapter is cheapest to run, from the engines' own
    ``vllm:lora_requests_info`` (llm-d's values): running it already, then a free slot (it
    loads without evicting an adapter in use), then queued there (it is loaded when its
    turn comes), last a worker whose slots are all taken by other adapters. Only workers
    that list the adapter are candidates; one whose metrics say nothing of LoRA yet counts
    as a free slot. A base-model request abstains, so it changes no other score."""

    name = "lora_affinity"
    uses_prefix = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        running: float = Field(default=1.0, ge=0, le=1, description="the adapter runs there")
        free_slot: float = Field(default=0.8, ge=0, le=1, description="a slot is free")
        waiting: float = Field(default=0.6, ge=0, le=1, description="the adapter waits there")
        busy: float = Field(default=0.0, ge=0, le=1, description="every slot holds another")

    def __init__(self, params: Params | None = None) -> None:
        self.p = params or self.Params()

    def score(self, ctx: Context, workers: list[Worker]) -> list[float] | None:
        name = ctx.lora_name
        if name is None:
            return None
        p = self.p
        out = []
        for w in workers:
            lora = w.lora
            if lora is None:
                out.append(p.free_slot)
            elif name in lora.running:
                out.append(p.running)
            elif lora.free_slot:
                out.append(p.free_slot)
            elif name in lora.waiting:
                out.append(p.waiting)
            else:
                out.append(p.busy)
        return out


class SessionAffinityScorer:
    """1.0 for the session's home worker (the shared session ranking), 0 elsewhere."""

    name = "session_affinity"
    uses_prefix = False
    Params = NoParams

    def score(self, ctx: Context, workers: list[Worker]) -> list[float]:
        if ctx.session_key is None or not workers:
            return [0.0] * len(workers)
        home = session_ranking(ctx.session_key, [w.id for w in workers])[0]
        return [1.0 if i == home else 0.0 for i in range(len(workers))]
