"""Turning engine event batches into index updates, per publisher.

Engine hashes are never trusted to equal our keys: each ``BlockStored`` is re-keyed
from its ``token_ids`` (chained from the parent's key, which we look up in the
engine-hash -> key map), and ``BlockRemoved`` is resolved through the same map.
A stored block whose parent we never saw (a store that joined late) cannot be
chained and is skipped; the index converges as the engine stores new prefixes.

The block size is the engine's: every ``BlockStored`` carries it, and the first one
fixes it for this publisher (until the publisher restarts), so no one has to configure it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from switchyard.kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)
from switchyard.kvstore.index import Add, Clear, Location, Op, Remove, tier_of
from switchyard.kvstore.keys import chain_keys, key_extra, root_key

log = logging.getLogger("switchyard.kvstore.ingest")


@dataclass(slots=True)
class IngestStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphan_blocks: int = 0
    skipped_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StoredTokens:
    """What one ``BlockStored`` said, kept briefly for the hash-parity check."""

    serial: int
    rank: int
    parent_block_hash: EngineHash | None
    block_hashes: Sequence[EngineHash]  # the event's own lists: decoded events are not changed
    token_ids: Sequence[int]
    block_size: int


RECENT_STORED = 256


def cache_salt_of(event: BlockStored) -> str | None:
    """vLLM puts ``cache_salt`` in the first block's extra keys, after the LoRA name.

    The extra keys of block 0 are ``(mm identifiers…, lora_name?, cache_salt?, …)``: the
    last string that is not the LoRA name is taken as the salt.
    """
    if event.parent_block_hash is not None or not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    strings = [x for x in first if isinstance(x, str) and x != event.lora_name]
    return strings[-1] if strings else None


class Ingestor:
    """Re-keys the events of ONE publisher (one engine instance) into index operations."""

    def __init__(
        self,
        instance: str,
        seed: int = 0,
        default_rank: int = 0,
        max_mapped_blocks: int = 2_000_000,
    ) -> None:
        self.instance = instance
        # Learned from the first BlockStored; None until then.
        self.block_size: int | None = None
        self.seed = seed
        self.default_rank = default_rank
        self.max_mapped_blocks = max_mapped_blocks
        self.ranks_seen: set[int] = set()
        self.stats = IngestStats()
        # engine hash -> our key, per (rank, tier); bounded so a lossy stream cannot leak.
        self._maps: dict[tuple[int, str], dict[EngineHash, int]] = {}
        self._locations: dict[tuple[int, str], Location] = {}
        self._warned_block_size = False
        # The last BlockStored events as published (serial numbers grow by one per event).
        self.recent: deque[StoredTokens] = deque(maxlen=RECENT_STORED)
        self.stored_serial = 0

    def _map(self, rank: int, tier: str) -> dict[EngineHash, int]:
        m = self._maps.get((rank, tier))
        if m is None:
            m = self._maps[(rank, tier)] = {}
        return m

    def mapped_blocks(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def forget(self, rank: int | None = None) -> None:
        """Drop the hash maps (publisher restarted: its hashes may be seeded anew).

        A restarted publisher may also come back with another block size.
        """
        if rank is None:
            self._maps.clear()
            self.block_size = None
            self._warned_block_size = False
        else:
            for key in [k for k in self._maps if k[0] == rank]:
                del self._maps[key]

    def snapshot(self) -> list[Op]:
        """Operations that rewrite this publisher's index entries from what it holds now.

        The hash maps follow every store and removal, also while the backend is down,
        so they are the engine's cache as its events describe it.
        """
        ops: list[Op] = [Clear(self.instance, rank) for rank in sorted(self.ranks_seen)]
        for (rank, tier), hmap in self._maps.items():
            if hmap:
                ops.append(Add(list(hmap.values()), Location(self.instance, rank, tier)))
        return ops

    def _location(self, rank: int, tier: str) -> Location:
        loc = self._locations.get((rank, tier))
        if loc is None:
            loc = self._locations[(rank, tier)] = Location(self.instance, rank, tier)
        return loc

    def ops(self, batch: EventBatch) -> list[Op]:
        """Index operations for one batch, in event order. Consecutive removals from one
        tier become one ``Remove``: vLLM publishes one ``BlockRemoved`` per evicted block,
        and on the Mooncake replay nearly all of a batch's events are those."""
        rank = self.default_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
        self.ranks_seen.add(rank)
        st = self.stats
        st.batches += 1
        st.events += len(batch.events)
        out: list[Op] = []
        removed: list[int] | None = None  # the keys of the Remove last appended to ``out``
        medium: str | None = None  # of the removals in a row, whose hash map ``pop`` is
        pop: Callable[[EngineHash, None], int | None] | None = None
        tier = ""
        n_removed = 0
        for ev in batch.events:
            if type(ev) is BlockRemoved:
                if ev.medium != medium or pop is None:
                    medium = ev.medium
                    tier = tier_of(ev.medium)
                    pop = self._map(rank, tier).pop
                    removed = None
                for h in ev.block_hashes:
                    key = pop(h, None)
                    if key is None:
                        continue
                    if removed is None:
                        removed = []
                        out.append(Remove(removed, self._location(rank, tier)))
                    removed.append(key)
                    n_removed += 1
                continue
            removed, pop = None, None
            if type(ev) is BlockStored:
                op = self._stored(ev, rank)
                if op is not None:
                    out.append(op)
            elif type(ev) is AllBlocksCleared:
                st.clears += 1
                self.forget(rank)
                out.append(Clear(self.instance, rank))
        st.blocks_removed += n_removed
        return out

    def _stored(self, ev: BlockStored, rank: int) -> Add | None:
        n = len(ev.block_hashes)
        self.stored_serial += 1
        self.recent.append(
            StoredTokens(
                self.stored_serial,
                rank,
                ev.parent_block_hash,
                ev.block_hashes,
                ev.token_ids,
                ev.block_size,
            )
        )
        if self.block_size is None and ev.block_size > 0 and len(ev.token_ids) == n * ev.block_size:
            self.block_size = ev.block_size
            log.info("%s: engine block size %d (from its events)", self.instance, ev.block_size)
        if ev.block_size != self.block_size or len(ev.token_ids) != n * ev.block_size:
            self.stats.skipped_blocks += n
            if not self._warned_block_size:
                self._warned_block_size = True
                log.warning(
                    "%s: BlockStored with block_size=%d and %d tokens for %d blocks; this "
                    "publisher's blocks have %s tokens, so these blocks are not indexed",
                    self.instance,
                    ev.block_size,
                    len(ev.token_ids),
                    n,
                    self.block_size,
                )
            return None
        tier = tier_of(ev.medium)
        hmap = self._map(rank, tier)
        if ev.parent_block_hash is None:
            parent = root_key(self.seed, key_extra(ev.lora_name, cache_salt_of(ev)))
        else:
            found = hmap.get(ev.parent_block_hash)
            if found is None:
                # The parent may sit in another tier's map (offload keeps the same hash).
                for (r, _), other in self._maps.items():
                    if r == rank and (found := other.get(ev.parent_block_hash)) is not None:
                        break
            if found is None:
                self.stats.orphan_blocks += n
                return None
            parent = found
        keys = chain_keys(parent, ev.token_ids, ev.block_size, self.seed)
        for h, k in zip(ev.block_hashes, keys, strict=True):
            hmap[h] = k
        self.stats.blocks_stored += n
        if len(hmap) > self.max_mapped_blocks:
            for h in list(islice(iter(hmap), len(hmap) - self.max_mapped_blocks)):
                del hmap[h]
        return Add(keys, self._location(rank, tier))
