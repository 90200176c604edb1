"""Named policies users know, each a configuration of the one scheduling framework.

A policy may also be spelled out in YAML (``policy: custom`` with ``policy_options``:
``scorers: {load: 1.0}``, ``picker: {name: power_of_two}``, ``filters: {max_inflight: 64}``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.scheduler.filters import MaxInflightFilter
from router.scheduler.framework import Filter, Picker, Scheduler, Scorer
from router.scheduler.pickers import (
    ConsistentHashPicker,
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
)
from router.scheduler.scorers import InflightScorer

SCORERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "load": lambda _: InflightScorer(),
}

PICKERS: dict[str, Callable[[dict[str, Any]], Picker]] = {
    "round_robin": lambda _: RoundRobinPicker(),
    "random": lambda o: RandomPicker(o.get("seed")),
    "max_score": lambda o: MaxScorePicker(o.get("seed")),
    "power_of_two": lambda o: PowerOfTwoPicker(o.get("seed")),
    "consistent_hash": lambda o: ConsistentHashPicker(
        load_factor=float(o.get("load_factor", 1.25)), seed=o.get("seed")
    ),
}

FILTERS: dict[str, Callable[[Any], Filter]] = {
    "max_inflight": lambda limit: MaxInflightFilter(int(limit)),
}

# name -> (scorer weights, picker name)
NAMED: dict[str, tuple[dict[str, float], str]] = {
    "round_robin": ({}, "round_robin"),
    "random": ({}, "random"),
    "least_load": ({"load": 1.0}, "max_score"),
    "power_of_two": ({"load": 1.0}, "power_of_two"),
    "consistent_hash": ({"load": 1.0}, "consistent_hash"),
}


def policy_names() -> list[str]:
    return [*NAMED, "custom"]


def build_scheduler(policy: str, options: dict[str, Any] | None = None) -> Scheduler:
    options = dict(options or {})
    if policy == "custom":
        weights = {str(k): float(v) for k, v in (options.get("scorers") or {}).items()}
        picker_opts = dict(options.get("picker") or {"name": "max_score"})
        picker_name = str(picker_opts.pop("name", "max_score"))
    elif policy in NAMED:
        weights, picker_name = NAMED[policy]
        picker_opts = options
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
    )
