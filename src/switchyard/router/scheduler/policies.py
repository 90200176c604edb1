"""Named policies users know, each a configuration of the one scheduling framework.

Every scorer, picker, filter and the guard declares its options as a ``Params`` model
(``extra="forbid"``), which holds their defaults. A named policy takes a flat options
mapping and gives each option to the component that declares it; ``guard``,
``filters`` and ``seed`` belong to the policy itself. An option no component declares
is an error that names it and the allowed ones, so a typo cannot pass silently.

``policy: custom`` spells the cycle out: ``scorers: {kv_aware: 1.0, load: 0.2}`` (a
weight, or ``{weight: 1.0, prefill_weight: 2}``), ``picker: {name: softmax,
temperature: 0.05}`` (default ``max_score``), ``filters: {max_inflight: 64}``,
``guard: {epsilon: 0.25, slack: 2}``. It needs ``scorers`` or ``picker``: without
either it would rank every worker equally, which ``least_load`` does on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from switchyard.router.scheduler.filters import MaxInflightFilter
from switchyard.router.scheduler.framework import Filter, NoParams, Picker, Scheduler, Scorer
from switchyard.router.scheduler.guard import BoundedLoadGuard
from switchyard.router.scheduler.pickers import (
    CacheAwarePicker,
    ConsistentHashPicker,
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SeedParams,
    SoftmaxPicker,
)
from switchyard.router.scheduler.scorers import (
    InflightScorer,
    KVAwareScorer,
    KVPressureScorer,
    LatencyScorer,
    LoraAffinityScorer,
    PrefixCacheScorer,
    QueueScorer,
    SessionAffinityScorer,
)

T = TypeVar("T")


class PolicyError(ValueError):
    """A policy or its options cannot be built; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class Plugin(Generic[T]):
    """A component's options model and how to build it (with the router's block size)."""

    params: type[BaseModel]
    build: Callable[[Any, int], T]


SCORERS: dict[str, Plugin[Scorer]] = {
    "load": Plugin(NoParams, lambda p, bs: InflightScorer()),
    "prefix_cache": Plugin(NoParams, lambda p, bs: PrefixCacheScorer()),
    "kv_aware": Plugin(KVAwareScorer.Params, lambda p, bs: KVAwareScorer(p, block_size=bs)),
    "latency": Plugin(LatencyScorer.Params, lambda p, bs: LatencyScorer(p, block_size=bs)),
    "kv_pressure": Plugin(NoParams, lambda p, bs: KVPressureScorer()),
    "queue": Plugin(NoParams, lambda p, bs: QueueScorer()),
    "session_affinity": Plugin(NoParams, lambda p, bs: SessionAffinityScorer()),
    "lora_affinity": Plugin(LoraAffinityScorer.Params, lambda p, bs: LoraAffinityScorer(p)),
}

PICKERS: dict[str, Plugin[Picker]] = {
    "round_robin": Plugin(NoParams, lambda p, bs: RoundRobinPicker(p)),
    "random": Plugin(SeedParams, lambda p, bs: RandomPicker(p)),
    "max_score": Plugin(MaxScorePicker.Params, lambda p, bs: MaxScorePicker(p)),
    "power_of_two": Plugin(SeedParams, lambda p, bs: PowerOfTwoPicker(p)),
    "consistent_hash": Plugin(ConsistentHashPicker.Params, lambda p, bs: ConsistentHashPicker(p)),
    "softmax": Plugin(SoftmaxPicker.Params, lambda p, bs: SoftmaxPicker(p)),
    "cache_aware": Plugin(CacheAwarePicker.Params, lambda p, bs: CacheAwarePicker(p)),
}

FILTERS: dict[str, Plugin[Filter]] = {
    "max_inflight": Plugin(MaxInflightFilter.Params, lambda p, bs: MaxInflightFilter(p)),
}


@dataclass(frozen=True, slots=True)
class NamedPolicy:
    scorers: dict[str, float]
    picker: str
    guard: bool = False
    picker_defaults: dict[str, Any] = field(default_factory=dict)


NAMED: dict[str, NamedPolicy] = {
    "round_robin": NamedPolicy({}, "round_robin"),
    "random": NamedPolicy({}, "random"),
    "least_load": NamedPolicy({"load": 1.0}, "max_score"),
    "power_of_two": NamedPolicy({"load": 1.0}, "power_of_two"),
    "consistent_hash": NamedPolicy({"load": 1.0}, "consistent_hash"),
    "cache_aware": NamedPolicy({}, "cache_aware"),
    # kv_aware's costs are estimates: within 2% is a tie, rotated rather than decided by noise.
    # Adapter affinity weighs as much as the cost (it abstains on a base-model request): the
    # cost already keys an adapter's cached prefix with its name; affinity spares a slot swap.
    "kv_aware": NamedPolicy(
        {"kv_aware": 1.0, "lora_affinity": 1.0}, "max_score", True, {"tie_tolerance": 0.02}
    ),
    # kv_aware's cost with each worker's work priced at its learned prefill speed.
    "latency": NamedPolicy(
        {"latency": 1.0, "lora_affinity": 1.0}, "max_score", True, {"tie_tolerance": 0.02}
    ),
}

# Options of the policy itself rather than of one component.
POLICY_KEYS = ("filters", "guard", "seed")
CUSTOM_KEYS = ("picker", "scorers")


def policy_names() -> list[str]:
    return [*NAMED, "custom"]


@dataclass(slots=True)
class _Part:
    """One component being configured: its label for errors, options model and options."""

    label: str
    params: type[BaseModel]
    options: dict[str, Any]


def build_scheduler(
    policy: str, options: Mapping[str, Any] | None = None, *, block_size: int | None = None
) -> Scheduler:
    """The scheduler of a named or custom policy; ``PolicyError`` names any bad option."""
    opts = dict(options or {})
    bs = block_size or _default_block_size()
    if policy == "custom":
        weights, scorer_opts = _custom_scorers(opts.pop("scorers", None))
        picker_name, picker_opts = _custom_picker(opts.pop("picker", None))
        if not weights and picker_name is None:
            raise PolicyError(
                "policy custom needs policy_options 'scorers' or 'picker', e.g. "
                '{"scorers": {"load": 1}}; for plain least-load routing use --policy least_load'
            )
        named = NamedPolicy(weights, picker_name or "max_score")
    elif policy in NAMED:
        named = NAMED[policy]
        scorer_opts = {name: {} for name in named.scorers}
        picker_opts = {}
    else:
        raise PolicyError(f"unknown policy {policy!r}; choose one of {', '.join(policy_names())}")

    picker = _Part(f"picker {named.picker}", PICKERS[named.picker].params, picker_opts)
    scorers = {
        name: _Part(f"scorer {name}", SCORERS[name].params, scorer_opts[name])
        for name in named.scorers
    }
    guard_option = opts.pop("guard", named.guard)
    filter_options = opts.pop("filters", None) or {}
    seed = opts.pop("seed", None)
    parts = [picker, *scorers.values()]
    _route(policy, opts, parts)
    for key, value in named.picker_defaults.items():
        picker.options.setdefault(key, value)
    if seed is not None:
        for part in parts:
            if "seed" in part.params.model_fields:
                part.options.setdefault("seed", seed)
    return Scheduler(
        policy=policy,
        picker=PICKERS[named.picker].build(_validate(policy, picker), bs),
        filters=_filters(policy, filter_options, bs),
        scorers=[
            (SCORERS[name].build(_validate(policy, scorers[name]), bs), weight)
            for name, weight in named.scorers.items()
        ],
        guard=_guard(policy, guard_option),
    )


def allowed_options(policy: str) -> list[str]:
    """Every option a named policy accepts (its components' and its own)."""
    named = NAMED[policy]
    keys = set(PICKERS[named.picker].params.model_fields)
    for name in named.scorers:
        keys |= set(SCORERS[name].params.model_fields)
    return sorted(keys | set(POLICY_KEYS))


def _route(policy: str, flat: dict[str, Any], parts: list[_Part]) -> None:
    """Give each flat option to every component that declares it; refuse the rest."""
    for key, value in flat.items():
        takers = [p for p in parts if key in p.params.model_fields]
        if not takers:
            allowed = {k for p in parts for k in p.params.model_fields} | set(POLICY_KEYS)
            if policy == "custom":
                allowed |= set(CUSTOM_KEYS)
            raise PolicyError(
                f"policy {policy}: unknown option {key!r}; allowed: {', '.join(sorted(allowed))}"
            )
        for part in takers:
            part.options.setdefault(key, value)


def _validate(policy: str, part: _Part) -> BaseModel:
    try:
        return part.params.model_validate(part.options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or part.label
        allowed = ", ".join(part.params.model_fields) or "none"
        if err["type"] == "extra_forbidden":
            why = f"unknown option {key!r}; allowed: {allowed}"
        else:
            why = f"option {key}: {err['msg']}"
        raise PolicyError(f"policy {policy}: {part.label} {why}") from None


def _custom_scorers(option: Any) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    if option is None:
        return {}, {}
    if not isinstance(option, Mapping):
        raise PolicyError(f"policy custom: 'scorers' must map scorer names to weights: {option!r}")
    weights: dict[str, float] = {}
    per: dict[str, dict[str, Any]] = {}
    for name, spec in option.items():
        if name not in SCORERS:
            raise PolicyError(f"unknown scorer {name!r}; choose from {', '.join(SCORERS)}")
        params = dict(spec) if isinstance(spec, Mapping) else {"weight": spec}
        weight = params.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise PolicyError(f"policy custom: scorer {name} weight must be a number: {weight!r}")
        weights[str(name)] = float(weight)
        per[str(name)] = params
    return weights, per


def _custom_picker(option: Any) -> tuple[str | None, dict[str, Any]]:
    if option is None:
        return None, {}
    params = {"name": option} if isinstance(option, str) else dict(option)
    name = str(params.pop("name", "max_score"))
    if name not in PICKERS:
        raise PolicyError(f"unknown picker {name!r}; choose from {', '.join(PICKERS)}")
    return name, params


def _filters(policy: str, option: Any, bs: int) -> list[Filter]:
    if not isinstance(option, Mapping):
        raise PolicyError(f"policy {policy}: 'filters' must be a mapping, not {option!r}")
    out = []
    for name, arg in option.items():
        if name not in FILTERS:
            raise PolicyError(f"unknown filter {name!r}; choose from {', '.join(FILTERS)}")
        part = _Part(f"filter {name}", FILTERS[name].params, {})
        part.options = dict(arg) if isinstance(arg, Mapping) else {"limit": arg}
        out.append(FILTERS[name].build(_validate(policy, part), bs))
    return out


def _guard(policy: str, option: Any) -> BoundedLoadGuard | None:
    if option is False or option is None:
        return None
    if option is True:
        return BoundedLoadGuard()
    if isinstance(option, Mapping):
        part = _Part("guard", BoundedLoadGuard.Params, dict(option))
        params = _validate(policy, part)
        assert isinstance(params, BoundedLoadGuard.Params)
        return BoundedLoadGuard(params)
    raise PolicyError(f"policy {policy}: guard must be true, false or a mapping, not {option!r}")


def _default_block_size() -> int:
    """The router's configured default, for schedulers built without settings at hand."""
    from switchyard.kvstore.settings import KVStoreSettings

    default = KVStoreSettings.model_fields["block_size"].default
    assert isinstance(default, int)
    return default
