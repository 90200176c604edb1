"""In-memory prefix index: the embedded default.

Layout chosen for lookup speed and bytes per block: one ``dict`` from block key to
an ``int`` bitmask of location slots (a location is interned to a bit). A lookup is
then one dict probe and one AND per block, whatever the number of engines. The
dict's insertion order doubles as the LRU order: a hit or a store re-inserts the
key at the end, and eviction drops a batch from the front.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_right
from collections.abc import Callable, Collection
from itertools import accumulate, islice, repeat
from operator import and_, neg

from switchyard.kvstore.index import (
    Add,
    BackendKind,
    Clear,
    Location,
    LocationInfo,
    Match,
    Op,
    Remove,
    rank_matches,
)
from switchyard.kvstore.settings import CAPACITY_BLOCKS

# Blocks the first stretch of a lookup's walk reads (``MemoryIndex._walk``).
_FIRST_STRETCH = 64
# How far back from a match's end ``_touch`` looks for a prefix it moved lately, and how
# many such prefixes it remembers.
_TOUCH_LOOKBACK = 64
_TOUCHED_HELD = 4096


class MemoryIndex:
    kind: BackendKind = "memory"

    def __init__(
        self,
        *,
        capacity_blocks: int = CAPACITY_BLOCKS,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._now = clock or time.monotonic
        self._map: dict[int, int] = {}
        self._slot: dict[Location, int] = {}
        self._loc: list[Location | None] = []
        self._free: list[int] = []
        self._count: list[int] = []
        self._all_mask = 0
        # Speculative entries: (key, bit) -> expiry, and a heap to expire them in order,
        # one item per placement: (expiry, sequence number, its keys, bit). One push per
        # placement, not per block: a push per block made a long placement slow, and the
        # heap held every repeat until it expired.
        self._spec: dict[tuple[int, int], float] = {}
        self._spec_heap: list[tuple[float, int, list[int], int]] = []
        self._spec_seq = 0
        self.evicted_blocks = 0
        # Keys put at the LRU tail so far, and when (in that count) the prefix ending with
        # each of the last keys a lookup matched was moved there (``_touch``).
        self._moved = 0
        self._touched: dict[int, int] = {}

    # -- slots ---------------------------------------------------------------------------

    def _bit(self, location: Location) -> int:
        bit = self._slot.get(location)
        if bit is None:
            if self._free:
                bit = self._free.pop()
                self._loc[bit] = location
                self._count[bit] = 0
            else:
                bit = len(self._loc)
                self._loc.append(location)
                self._count.append(0)
            self._slot[location] = bit
            self._all_mask |= 1 << bit
        return bit

    def _uncount(self, mask: int) -> None:
        count = self._count
        while mask:
            low = mask & -mask
            count[low.bit_length() - 1] -= 1
            mask ^= low

    # -- speculative expiry ----------------------------------------------------------------

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        spec = self._spec
        while heap and heap[0][0] <= now:
            expiry, _, keys, bit = heapq.heappop(heap)
            for key in keys:
                if spec.get((key, bit)) != expiry:
                    continue  # confirmed by an event, removed, or placed again since
                del spec[(key, bit)]
                m = self._map.get(key)
                if m is not None and m >> bit & 1:
                    self._drop_bit(key, m, bit)

    def _drop_bit(self, key: int, mask: int, bit: int) -> None:
        rest = mask & ~(1 << bit)
        if rest:
            self._map[key] = rest
        else:
            del self._map[key]
        self._count[bit] -= 1

    # -- updates ---------------------------------------------------------------------------

    def add_sync(self, keys: list[int], location: Location, ttl_s: float | None = None) -> None:
        bit = self._bit(location)
        b = 1 << bit
        d = self._map
        pop = d.pop
        added = 0
        if ttl_s is None:
            for k in keys:
                m = pop(k, 0)
                if not m & b:
                    added += 1
                d[k] = m | b
            if self._spec:
                confirm = self._spec.pop
                for k in keys:
                    confirm((k, bit), None)
            self._moved += len(keys)
        else:
            expiry = self._now() + ttl_s
            spec = self._spec
            timed: list[int] = []
            for k in keys:
                m = pop(k, 0)
                d[k] = m | b
                if not m & b:
                    added += 1
                elif (k, bit) not in spec:
                    continue  # an engine-confirmed entry is not downgraded to speculative
                spec[(k, bit)] = expiry
                timed.append(k)
            if timed:
                self._spec_seq += 1
                heapq.heappush(self._spec_heap, (expiry, self._spec_seq, timed, bit))
            self._moved += len(keys)
        self._count[bit] += added
        if len(d) > self.capacity_blocks:
            self._evict(len(d) - self.capacity_blocks + max(1, self.capacity_blocks // 64))

    def _evict(self, n: int) -> None:
        d = self._map
        victims = list(islice(iter(d), n))
        for k in victims:
            self._uncount(d.pop(k))
        self.evicted_blocks += len(victims)

    def remove_sync(self, keys: list[int], location: Location) -> None:
        bit = self._slot.get(location)
        if bit is None:
            return
        d = self._map
        spec = self._spec
        for k in keys:
            m = d.get(k)
            if m is not None and m >> bit & 1:
                self._drop_bit(k, m, bit)
                if spec:
                    spec.pop((k, bit), None)

    def clear_sync(self, instance: str, dp_rank: int | None = None) -> None:
        bits = [
            bit
            for loc, bit in self._slot.items()
            if loc.instance == instance and (dp_rank is None or loc.dp_rank == dp_rank)
        ]
        if not bits:
            return
        mask = 0
        for bit in bits:
            mask |= 1 << bit
        d = self._map
        for k in [k for k, m in d.items() if m & mask]:
            rest = d[k] & ~mask
            if rest:
                d[k] = rest
            else:
                del d[k]
        if self._spec:
            self._spec = {kb: e for kb, e in self._spec.items() if not (mask >> kb[1] & 1)}
        for bit in bits:
            loc = self._loc[bit]
            if loc is not None:
                del self._slot[loc]
            self._loc[bit] = None
            self._count[bit] = 0
            self._free.append(bit)
        self._all_mask &= ~mask

    def apply_sync(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Add):
                self.add_sync(op.keys, op.location)
            elif isinstance(op, Remove):
                self.remove_sync(op.keys, op.location)
            elif isinstance(op, Clear):
                self.clear_sync(op.instance, op.dp_rank)

    # -- lookup ----------------------------------------------------------------------------

    def lookup_sync(
        self, keys: list[int], candidates: Collection[str] | None = None, *, block_size: int
    ) -> list[Match]:
        if self._spec_heap and self._spec_heap[0][0] <= self._now():
            self._expire(self._now())
        if candidates is None:
            alive = self._all_mask
        else:
            wanted = set(candidates)
            alive = 0
            for loc, bit in self._slot.items():
                if loc.instance in wanted:
                    alive |= 1 << bit
        runs: list[tuple[int, int]] = []
        done = 0
        if alive:
            alive, done = self._walk(keys, alive, runs)
        if alive:
            runs.append((alive, done))
        if done:
            self._touch(keys, max(n for _, n in runs))
        bs = block_size
        out: list[Match] = []
        for mask, n in runs:
            if n == 0:
                continue
            while mask:
                low = mask & -mask
                held = self._loc[low.bit_length() - 1]
                if held is not None:
                    out.append(Match(held.instance, held.dp_rank, held.tier, n * bs))
                mask ^= low
        return rank_matches(out)

    def _walk(self, keys: list[int], alive: int, runs: list[tuple[int, int]]) -> tuple[int, int]:
        """The locations still matching after the consecutive blocks that some of ``alive``
        hold, and how many those are; each location's drop-out goes to ``runs`` (its bits,
        the blocks it matched).

        In C, a stretch at a time: each block's mask, and the running AND of them (a block
        not held is mask 0). That AND only loses bits, so it never grows as a number, and
        each place it drops is found by bisection. A Python step per block was most of a
        long prompt's lookup. Stretches grow fourfold, so a match that ends early reads
        few blocks.
        """
        get = self._map.get
        done = 0
        stretch = _FIRST_STRETCH
        while done < len(keys):
            part = keys[done : done + stretch]
            acc = list(accumulate(map(get, part, repeat(0)), and_, initial=alive))
            at = 0  # acc[at] == alive: the running AND after ``at`` blocks of the stretch
            while True:
                nxt = bisect_right(acc, -alive, lo=at, key=neg)  # the first index below alive
                if nxt == len(acc):
                    break
                lower = acc[nxt]
                runs.append((alive ^ lower, done + nxt - 1))
                alive, at = lower, nxt
                if not alive:
                    return 0, done + nxt - 1
            done += len(part)
            stretch *= 4
        return alive, done

    def _touch(self, keys: list[int], n: int) -> None:
        """Move the matched prefix to the LRU tail: hot shared prefixes are never evicted.

        Not the part a lookup moved lately: a key moved to the tail is evicted only once
        about ``capacity_blocks`` keys went in or moved behind it, so a prefix moved less
        than half that ago is safe, and the next turn of a chat moves only the blocks it
        adds (its earlier prefix is found by its last key, a few keys back). Popped and
        put back in one ``dict.update``, in C.
        """
        d = self._map
        touched = self._touched
        fresh = self._moved - self.capacity_blocks // 2
        start = 0
        for i in range(n - 1, max(-1, n - 1 - _TOUCH_LOOKBACK), -1):
            at = touched.get(keys[i])
            if at is not None and at > fresh:
                start = i + 1
                break
        head = keys[start:n]
        d.update(zip(head, map(d.pop, head), strict=True))
        self._moved += len(head)
        if head:
            if len(touched) >= _TOUCHED_HELD:
                touched.clear()
            touched[keys[n - 1]] = self._moved

    # -- introspection ---------------------------------------------------------------------

    def locations_sync(self) -> list[LocationInfo]:
        return [
            LocationInfo(loc, self._count[bit])
            for bit, loc in enumerate(self._loc)
            if loc is not None
        ]

    def __len__(self) -> int:
        return len(self._map)

    # -- KVIndex (async facade: the memory backend never suspends) -------------------------

    async def lookup(
        self, keys: list[int], candidates: Collection[str] | None = None, *, block_size: int
    ) -> list[Match]:
        return self.lookup_sync(keys, candidates, block_size=block_size)

    async def add(self, keys: list[int], location: Location, ttl_s: float | None = None) -> None:
        self.add_sync(keys, location, ttl_s)

    async def remove(self, keys: list[int], location: Location) -> None:
        self.remove_sync(keys, location)

    async def clear(self, instance: str, dp_rank: int | None = None) -> None:
        self.clear_sync(instance, dp_rank)

    async def apply(self, ops: list[Op]) -> None:
        self.apply_sync(ops)

    async def locations(self) -> list[LocationInfo]:
        return self.locations_sync()

    async def size(self) -> int:
        return sum(c for c, loc in zip(self._count, self._loc, strict=True) if loc is not None)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
