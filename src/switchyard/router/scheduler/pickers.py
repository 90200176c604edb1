"""Pickers: turn combined scores into a preference order (the first is the pick)."""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from switchyard.router.scheduler.framework import Context, NoParams
from switchyard.router.scheduler.session import session_ranking

if TYPE_CHECKING:
    from switchyard.balancer.worker import Worker


def _by_score(workers: list[Worker], scores: list[float], rng: random.Random) -> list[Worker]:
    """Highest score first; ties broken at random so equal workers share the load."""
    keyed = sorted(
        zip(scores, [rng.random() for _ in workers], range(len(workers)), strict=True), reverse=True
    )
    return [workers[i] for _, _, i in keyed]


class SeedParams(BaseModel):
    """Options of a picker that draws at random: a seed makes its draws repeatable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int | None = Field(default=None, description="random seed (None: from the OS)")


class RoundRobinPicker:
    name = "round_robin"
    uses_prefix = False
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self._counter = itertools.count()
        # The candidates as last given and sorted by id: the fleet hands the same workers
        # decision after decision, so the sort is redone only when they change.
        self._given: list[Worker] = []
        self._ranked: list[Worker] = []

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        if workers != self._given:
            self._given = list(workers)
            self._ranked = sorted(workers, key=lambda w: w.id)
        ranked = self._ranked
        start = next(self._counter) % len(ranked)
        return ranked[start:] + ranked[:start]


class RandomPicker:
    name = "random"
    uses_prefix = False
    Params = SeedParams

    def __init__(self, params: SeedParams | None = None) -> None:
        self._rng = random.Random((params or SeedParams()).seed)

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        return self._rng.sample(workers, len(workers))


class MaxScorePicker:
    """Highest score first; near-ties go to the least-busy, least-recently-picked worker.

    Scores within ``tie_tolerance`` (relative) of the best count as a tie: the signals
    behind them are estimates, and breaking such ties by noise (or at random) lets one
    worker win run after run. Rotating among tied workers spreads them evenly.

    The rotation follows the later of this picker's own last pick of a worker and the
    last request begun on it by any process (``Worker.begun_at``). With its own picks
    alone, the processes of one router rotated in step and sent new conversations to the
    same half of the fleet, lowering kv_aware's hit rate and loading it unevenly
    (``bench.compare_routing multiturn``).
    """

    name = "max_score"
    uses_prefix = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        tie_tolerance: float = Field(
            default=0.0, ge=0, lt=1, description="scores this close (relative) to the best tie"
        )

    def __init__(self, params: Params | None = None) -> None:
        self.tie_tolerance = (params or self.Params()).tie_tolerance
        self._last: dict[str, float] = {}

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        floor = max(scores) * (1.0 - self.tie_tolerance)
        get = self._last.get
        # Keys built in one comprehension and sorted as tuples (the index last keeps a
        # stable sort's order): a third of the time of a key function per candidate. The
        # later of two times by a comparison, not max(), whose keyword parse costs more.
        keyed = [
            (
                s < floor,
                0.0 if s >= floor else -s,
                w.inflight,
                last if (last := get(w.id, 0.0)) >= w.begun_at else w.begun_at,
                i,
            )
            for i, (s, w) in enumerate(zip(scores, workers, strict=True))
        ]
        keyed.sort()
        order = [workers[k[4]] for k in keyed]
        self._last[order[0].id] = time.monotonic()
        return order


class PowerOfTwoPicker:
    """Sample two candidates, prefer the better: near-least-load without herding."""

    name = "power_of_two"
    uses_prefix = False
    Params = SeedParams

    def __init__(self, params: SeedParams | None = None) -> None:
        self._rng = random.Random((params or SeedParams()).seed)

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        if len(workers) <= 2:
            return _by_score(workers, scores, self._rng)
        i, j = self._rng.sample(range(len(workers)), 2)
        first, second = (i, j) if scores[i] >= scores[j] else (j, i)
        rest = [k for k in range(len(workers)) if k not in (i, j)]
        ordered_rest = _by_score([workers[k] for k in rest], [scores[k] for k in rest], self._rng)
        return [workers[first], workers[second], *ordered_rest]


class ConsistentHashPicker:
    """Session affinity by the shared session ranking, with bounded load (Mirrokni et al.).

    A worker is skipped while its in-flight count would exceed ``load_factor`` times
    the fleet mean, so one hot session cannot sink a worker; requests without a
    session key go to the least-loaded worker.
    """

    name = "consistent_hash"
    uses_prefix = False

    class Params(SeedParams):
        load_factor: float = Field(
            default=1.25, ge=1.0, description="skip a worker above this x the mean in-flight"
        )

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self.load_factor = p.load_factor
        self._rng = random.Random(p.seed)

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        if ctx.session_key is None:
            return _by_score(workers, scores, self._rng)
        walk = [workers[i] for i in session_ranking(ctx.session_key, [w.id for w in workers])]
        total = sum(w.inflight for w in workers)
        capacity = math.ceil(self.load_factor * (total + 1) / len(workers))
        fits = [w for w in walk if w.inflight < capacity]
        return fits + [w for w in walk if w.inflight >= capacity]


class SoftmaxPicker:
    """Sample by softmax(score / temperature): spreads near-ties, follows clear winners.

    Temperature 0 is max score. Sampled without replacement, so the whole order is
    a preference list for failover.
    """

    name = "softmax"
    uses_prefix = False

    class Params(SeedParams):
        temperature: float = Field(default=0.1, ge=0, description="0 is max score")

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self.temperature = p.temperature
        self._rng = random.Random(p.seed)

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        if self.temperature <= 0 or len(workers) == 1:
            return _by_score(workers, scores, self._rng)
        top = max(scores)
        weights = [math.exp((s - top) / self.temperature) for s in scores]
        keyed = sorted(
            ((self._rng.random() ** (1.0 / w) if w > 0 else 0.0), i) for i, w in enumerate(weights)
        )
        return [workers[i] for _, i in reversed(keyed)]


class CacheAwarePicker:
    """SGLang's cache-aware policy, on the KV store's matches instead of a router-side tree.

    When the fleet is imbalanced (max - min load > ``balance_abs_threshold`` and
    max > ``balance_rel_threshold`` x min) it takes the least-loaded worker. Otherwise
    the worker with the longest prefix match wins if the match covers more than
    ``cache_threshold`` of the prompt; below that, the least-loaded worker (SGLang
    picks the worker with the smallest tree, i.e. the most free cache; load is the
    signal we have for every engine).
    """

    name = "cache_aware"
    uses_prefix = True

    class Params(SeedParams):
        cache_threshold: float = Field(
            default=0.3, ge=0, le=1, description="share of the prompt a match must cover"
        )
        balance_abs_threshold: int = Field(
            default=64, ge=0, description="imbalanced when max - min in-flight exceeds this"
        )
        balance_rel_threshold: float = Field(
            default=1.5, ge=1, description="... and max exceeds this x min"
        )

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self.cache_threshold = p.cache_threshold
        self.balance_abs_threshold = p.balance_abs_threshold
        self.balance_rel_threshold = p.balance_rel_threshold
        self._rng = random.Random(p.seed)

    def order(self, ctx: Context, workers: list[Worker], scores: list[float]) -> list[Worker]:
        loads = [w.inflight for w in workers]
        by_load = _by_score(workers, [-float(x) for x in loads], self._rng)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            ctx.reason = "imbalanced"
            return by_load
        total = max(ctx.prompt_tokens, 1)
        best = max(workers, key=lambda w: (ctx.matched.get(w.id, 0.0), -w.inflight))
        if ctx.matched.get(best.id, 0.0) / total > self.cache_threshold:
            ctx.reason = "cache_hit"
            return [best, *(w for w in by_load if w is not best)]
        ctx.reason = "cache_miss"
        return by_load
