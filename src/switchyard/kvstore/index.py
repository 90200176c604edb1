"""The prefix index contract shared by the memory and Redis backends.

A *location* is one KV holder: an engine instance (its base URL), a DP rank and a
tier. ``lookup`` answers, for every location, the longest run of consecutive blocks
from block 0 that it holds; a run may not skip a block, because an engine can only
reuse a prefix, never a hole-punched one.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

TIERS: tuple[str, ...] = ("gpu", "cpu", "disk", "remote")
# A hit in a slower tier still saves prefill, but less: weights rank matches across tiers.
TIER_WEIGHTS: dict[str, float] = {"gpu": 1.0, "cpu": 0.8, "disk": 0.5, "remote": 0.3}


@dataclass(frozen=True, slots=True)
class Location:
    instance: str
    dp_rank: int = 0
    tier: str = "gpu"


@dataclass(slots=True)
class Match:
    instance: str
    dp_rank: int
    tier: str
    matched_tokens: int

    @property
    def weighted_tokens(self) -> float:
        """Matched tokens scaled by the tier's weight (what ranking across tiers uses)."""
        return self.matched_tokens * TIER_WEIGHTS.get(self.tier, 0.0)


@dataclass(frozen=True, slots=True)
class Add:
    keys: list[int]
    location: Location


@dataclass(frozen=True, slots=True)
class Remove:
    keys: list[int]
    location: Location


@dataclass(frozen=True, slots=True)
class Clear:
    instance: str
    dp_rank: int | None = None


Op = Add | Remove | Clear


@dataclass(slots=True)
class LocationInfo:
    location: Location
    blocks: int


def rank_matches(matches: list[Match]) -> list[Match]:
    """Best first: tier-weighted tokens, then raw tokens, then a stable name order."""
    return sorted(
        matches, key=lambda m: (-m.weighted_tokens, -m.matched_tokens, m.instance, m.dp_rank)
    )


@lru_cache(maxsize=256)
def tier_of(medium: str | None) -> str:
    """Engine medium names (vLLM ``GPU``/``CPU``, LMCache ``LocalDisk`` …) to our tiers."""
    if not medium:
        return "gpu"
    m = medium.lower()
    if m in TIERS:
        return m
    if "disk" in m or "ssd" in m or "file" in m:
        return "disk"
    if "cpu" in m or "dram" in m or "host" in m:
        return "cpu"
    return "remote"


BackendKind = Literal["memory", "redis"]


class KVIndex(Protocol):
    """What ``KVStore`` needs from a backend; every call may raise on backend failure."""

    kind: BackendKind

    async def lookup(
        self, keys: list[int], candidates: Collection[str] | None = None, *, block_size: int
    ) -> list[Match]:
        """Per location, the longest consecutive run from block 0 (best first).

        The index holds keys, not tokens: ``block_size`` is the size of the blocks these
        keys stand for (engines of one fleet may use different sizes).
        """

    async def add(self, keys: list[int], location: Location, ttl_s: float | None = None) -> None:
        """Record ``location`` as holding ``keys``; with ``ttl_s`` the entries are speculative."""

    async def remove(self, keys: list[int], location: Location) -> None:
        """Forget that ``location`` holds ``keys``."""

    async def clear(self, instance: str, dp_rank: int | None = None) -> None:
        """Forget every block of an instance (or of one of its DP ranks)."""

    async def apply(self, ops: list[Op]) -> None:
        """Apply one event batch's updates in order (batched where the backend can)."""

    async def locations(self) -> list[LocationInfo]:
        """Every known location with the number of blocks it holds."""

    async def size(self) -> int:
        """Indexed (block, location) entries."""

    async def ping(self) -> None:
        """Raise if the backend cannot answer."""

    async def close(self) -> None:
        """Release connections."""
