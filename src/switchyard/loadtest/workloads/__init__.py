"""Named workloads: ``build_workload(name, seed, **overrides)``.

Overrides are the fields of each workload's params dataclass (``rate``, ``duration_s``,
``max_tokens``, …); unknown names are refused so a typo cannot silently change nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads.mooncake import MooncakeParams, mooncake
from switchyard.loadtest.workloads.multiturn import MultiTurnParams, multiturn
from switchyard.loadtest.workloads.noisy import NoisyParams, noisy
from switchyard.loadtest.workloads.randomctl import RandomParams, random_prompts
from switchyard.loadtest.workloads.sharedprefix import SharedPrefixParams, shared_prefix

WORKLOADS: dict[str, tuple[type, Callable[..., Workload]]] = {
    "multiturn": (MultiTurnParams, multiturn),
    "shared_prefix": (SharedPrefixParams, shared_prefix),
    "random": (RandomParams, random_prompts),
    "mooncake": (MooncakeParams, mooncake),
    "noisy": (NoisyParams, noisy),
}


def build_workload(name: str, seed: int = 0, **overrides: Any) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    params_cls, make = WORKLOADS[name]
    fields = {f.name for f in dataclasses.fields(params_cls)}
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"workload {name!r} has no parameter(s) {', '.join(unknown)}")
    return make(seed, params_cls(**given))
