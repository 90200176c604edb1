"""Named policies users know, each a configuration of the one scheduling framework.

A policy may also be spelled out in YAML (``policy: custom`` with ``policy_options``:
``scorers: {kv_aware: 1.0, load: 0.2}``, ``picker: {name: softmax, temperature: 0.05}``,
``filters: {max_inflight: 64}``, ``guard: {epsilon: 0.25, slack: 2}``). Any policy takes
``guard`` (``false`` turns kv_aware's default guard off) and per-scorer options such
as ``prefill_weight``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.scheduler.filters import MaxInflightFilter
from router.scheduler.framework import Filter, Picker, Scheduler, Scorer
from router.scheduler.guard import BoundedLoadGuard
from router.scheduler.pickers import (
    CacheAwarePicker,
    ConsistentHashPicker,
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SoftmaxPicker,
)
from router.scheduler.scorers import (
    InflightScorer,
    KVAwareScorer,
    KVPressureScorer,
    PrefixCacheScorer,
    QueueScorer,
    SessionAffinityScorer,
)

SCORERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "load": lambda _: InflightScorer(),
    "prefix_cache": lambda _: PrefixCacheScorer(),
    "kv_aware": lambda o: KVAwareScorer(
        prefill_weight=float(o.get("prefill_weight", 1.0)),
        decode_weight=float(o.get("decode_weight", 0.25)),
        occupancy_weight=float(o.get("occupancy_weight", 1.0)),
        replication_weight=float(o.get("replication_weight", 5.0)),
    ),
    "kv_pressure": lambda _: KVPressureScorer(),
    "queue": lambda _: QueueScorer(),
    "session_affinity": lambda _: SessionAffinityScorer(),
}

PICKERS: dict[str, Callable[[dict[str, Any]], Picker]] = {
    "round_robin": lambda _: RoundRobinPicker(),
    "random": lambda o: RandomPicker(o.get("seed")),
    "max_score": lambda o: MaxScorePicker(float(o.get("tie_tolerance", 0.0))),
    "power_of_two": lambda o: PowerOfTwoPicker(o.get("seed")),
    "consistent_hash": lambda o: ConsistentHashPicker(
        load_factor=float(o.get("load_factor", 1.25)), seed=o.get("seed")
    ),
    "softmax": lambda o: SoftmaxPicker(float(o.get("temperature", 0.1)), seed=o.get("seed")),
    "cache_aware": lambda o: CacheAwarePicker(
        cache_threshold=float(o.get("cache_threshold", 0.3)),
        balance_abs_threshold=int(o.get("balance_abs_threshold", 64)),
        balance_rel_threshold=float(o.get("balance_rel_threshold", 1.5)),
        seed=o.get("seed"),
    ),
}

FILTERS: dict[str, Callable[[Any], Filter]] = {
    "max_inflight": lambda limit: MaxInflightFilter(int(limit)),
}

# name -> (scorer weights, picker name, hot-spot guard on by default)
NAMED: dict[str, tuple[dict[str, float], str, bool]] = {
    "round_robin": ({}, "round_robin", False),
    "random": ({}, "random", False),
    "least_load": ({"load": 1.0}, "max_score", False),
    "power_of_two": ({"load": 1.0}, "power_of_two", False),
    "consistent_hash": ({"load": 1.0}, "consistent_hash", False),
    "cache_aware": ({}, "cache_aware", False),
    "kv_aware": ({"kv_aware": 1.0}, "max_score", True),
}


# kv_aware's costs are estimates: within 2% is a tie, rotated rather than decided by noise.
PICKER_DEFAULTS: dict[str, dict[str, Any]] = {"kv_aware": {"tie_tolerance": 0.02}}


def policy_names() -> list[str]:
    return [*NAMED, "custom"]


def build_scheduler(policy: str, options: dict[str, Any] | None = None) -> Scheduler:
    options = dict(options or {})
    if policy == "custom":
        weights = {str(k): float(v) for k, v in (options.get("scorers") or {}).items()}
        picker_opts = dict(options.get("picker") or {"name": "max_score"})
        picker_name = str(picker_opts.pop("name", "max_score"))
        guard_default = False
    elif policy in NAMED:
        weights, picker_name, guard_default = NAMED[policy]
        picker_opts = {**PICKER_DEFAULTS.get(policy, {}), **options}
    else:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(policy_names())}")
    for name in weights:
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; choose from {', '.join(SCORERS)}")
    if picker_name not in PICKERS:
        raise ValueError(f"unknown picker {picker_name!r}; choose from {', '.join(PICKERS)}")
    filters = []
    for name, arg in (options.get("filters") or {}).items():
        if name not in FILTERS:
            raise ValueError(f"unknown filter {name!r}; choose from {', '.join(FILTERS)}")
        filters.append(FILTERS[name](arg))
    return Scheduler(
        policy=policy,
        picker=PICKERS[picker_name](picker_opts),
        filters=filters,
        scorers=[(SCORERS[name](options), w) for name, w in weights.items()],
        guard=_guard(options.get("guard", guard_default)),
    )


def _guard(option: Any) -> BoundedLoadGuard | None:
    if option is False or option is None:
        return None
    if option is True:
        return BoundedLoadGuard()
    if isinstance(option, dict):
        return BoundedLoadGuard(
            epsilon=float(option.get("epsilon", 0.5)), slack=float(option.get("slack", 4.0))
        )
    raise ValueError(f"guard must be true, false or a mapping, not {option!r}")
