"""KV-aware scheduling: prefix scorers, the kv_aware cost model, cache_aware, the hot-spot guard."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from switchyard.kvstore.index import Match
from switchyard.kvstore.store import LookupResult
from switchyard.router.scheduler.framework import Context
from switchyard.router.scheduler.guard import BoundedLoadGuard
from switchyard.router.scheduler.policies import build_scheduler


@dataclass
class FakeLoad:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_seqs: int = 0
    kv_usage: float | None = None
    engine_waiting: int | None = None


@dataclass
class FakeWorker:
    id: str
    inflight: int = 0
    begun_at: float = 0.0
    state: FakeLoad = field(default_factory=FakeLoad)
    dp_size: int = 1

    def load(self) -> FakeLoad:
        return self.state

    def queued_tokens(self) -> tuple[int, int]:
        return self.state.prefill_tokens, self.state.decode_tokens + self.state.decode_seqs


def ctx_with(total: int, matched: dict[str, int]) -> Context:
    ctx = Context(model="m")
    ctx.set_prefix(
        LookupResult(
            block_size=16,
            total_tokens=total,
            keys=list(range(total // 16)),
            matches=[Match(w, 0, "gpu", n) for w, n in matched.items()],
        )
    )
    return ctx


def test_kv_aware_prefers_the_worker_holding_the_prefix() -> None:
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    order = build_scheduler("kv_aware").schedule(ctx_with(4096, {"b": 4000}), workers)
    assert order[0].id == "b"


def test_kv_aware_leaves_a_prefix_holder_busy_with_long_decodes() -> None:
    busy = FakeWorker("b", inflight=1, state=FakeLoad(decode_tokens=200_000, decode_seqs=60))
    workers = [FakeWorker("a"), busy]
    order = build_scheduler("kv_aware", {"guard": False}).schedule(
        ctx_with(1024, {"b": 1024}), workers
    )
    assert order[0].id == "a"


def test_kv_aware_counts_queued_prefill_work() -> None:
    queued = FakeWorker("a", inflight=3, state=FakeLoad(prefill_tokens=50_000))
    order = build_scheduler("kv_aware").schedule(ctx_with(512, {}), [queued, FakeWorker("b")])
    assert order[0].id == "b"


def test_kv_aware_keeps_a_prefix_on_its_holder_over_a_slightly_shorter_queue() -> None:
    holder = FakeWorker("a", inflight=1, state=FakeLoad(prefill_tokens=1200))
    ctx = ctx_with(1024, {"a": 768})
    order = build_scheduler("kv_aware").schedule(ctx, [holder, FakeWorker("b")])
    assert order[0].id == "a"


def test_kv_aware_without_the_replication_cost_copies_the_prefix_to_the_idle_worker() -> None:
    holder = FakeWorker("a", inflight=1, state=FakeLoad(prefill_tokens=1200))
    ctx = ctx_with(1024, {"a": 768})
    scheduler = build_scheduler("kv_aware", {"replication_weight": 0.0})
    assert scheduler.schedule(ctx, [holder, FakeWorker("b")])[0].id == "b"


def test_prefix_cache_scorer_is_the_matched_share() -> None:
    scheduler = build_scheduler("custom", {"scorers": {"prefix_cache": 1.0}})
    workers = [FakeWorker("a"), FakeWorker("b")]
    assert scheduler.combined_scores(ctx_with(1000, {"a": 250}), workers) == [0.25, 0.0]


def test_weights_decide_between_cache_and_load() -> None:
    holder = FakeWorker("a", inflight=9)
    idle = FakeWorker("b", inflight=0)
    ctx = ctx_with(1000, {"a": 500})
    cache_heavy = build_scheduler("custom", {"scorers": {"prefix_cache": 3.0, "load": 1.0}})
    load_heavy = build_scheduler("custom", {"scorers": {"prefix_cache": 1.0, "load": 3.0}})
    assert cache_heavy.schedule(ctx, [holder, idle])[0].id == "a"
    assert load_heavy.schedule(ctx, [holder, idle])[0].id == "b"


def test_cache_aware_follows_a_match_above_the_threshold() -> None:
    workers = [FakeWorker("a", inflight=3), FakeWorker("b")]
    ctx = ctx_with(1000, {"a": 600})
    assert build_scheduler("cache_aware").schedule(ctx, workers)[0].id == "a"
    assert ctx.reason == "cache_hit"


def test_cache_aware_below_the_threshold_takes_the_least_loaded() -> None:
    workers = [FakeWorker("a", inflight=3), FakeWorker("b")]
    ctx = ctx_with(1000, {"a": 100})
    assert build_scheduler("cache_aware").schedule(ctx, workers)[0].id == "b"
    assert ctx.reason == "cache_miss"


def test_cache_aware_balances_when_the_fleet_is_imbalanced() -> None:
    workers = [FakeWorker("a", inflight=200), FakeWorker("b", inflight=10)]
    ctx = ctx_with(1000, {"a": 1000})
    assert build_scheduler("cache_aware").schedule(ctx, workers)[0].id == "b"
    assert ctx.reason == "imbalanced"


def test_guard_demotes_a_worker_above_the_bound() -> None:
    guard = BoundedLoadGuard(BoundedLoadGuard.Params(epsilon=0.25, slack=0))
    hot, cold = FakeWorker("hot", inflight=10), FakeWorker("cold", inflight=0)
    ctx = Context(model="m")
    assert [w.id for w in guard.apply(ctx, [hot, cold])] == ["cold", "hot"]
    assert ctx.reason == "guard"


def test_guard_keeps_affinity_under_light_load() -> None:
    guard = BoundedLoadGuard(BoundedLoadGuard.Params(epsilon=0.25, slack=2))
    holder, idle = FakeWorker("a", inflight=1), FakeWorker("b", inflight=0)
    assert guard.apply(Context(model="m"), [holder, idle])[0].id == "a"


def test_single_hot_prefix_stays_within_the_load_bound() -> None:
    """Every request shares one prefix held by one worker: the guard spreads the excess."""
    workers = [FakeWorker(f"w{i}") for i in range(8)]
    scheduler = build_scheduler("kv_aware", {"guard": {"epsilon": 0.15, "slack": 1}})
    for _ in range(400):
        pick = scheduler.schedule(ctx_with(2048, {"w0": 2048}), workers)[0]
        pick.inflight += 1
    loads = [w.inflight for w in workers]
    mean = sum(loads) / len(loads)
    assert max(loads) <= 1.15 * mean + 2
    assert loads[0] == max(loads)


def test_without_the_guard_a_hot_prefix_piles_onto_one_worker() -> None:
    workers = [FakeWorker(f"w{i}") for i in range(8)]
    scheduler = build_scheduler("kv_aware", {"guard": False})
    picks = Counter()
    for _ in range(100):
        pick = scheduler.schedule(ctx_with(2048, {"w0": 2048}), workers)[0]
        pick.inflight += 1
        picks[pick.id] += 1
    assert picks["w0"] > 50


def test_softmax_with_low_temperature_follows_the_best_score() -> None:
    scheduler = build_scheduler(
        "custom",
        {"scorers": {"prefix_cache": 1.0}, "picker": {"name": "softmax", "temperature": 0.01}},
    )
    workers = [FakeWorker("a"), FakeWorker("b")]
    picks = Counter(
        scheduler.schedule(ctx_with(1000, {"b": 900}), workers)[0].id for _ in range(50)
    )
    assert picks["b"] == 50
