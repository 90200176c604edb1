"""Paged KV blocks with vLLM V1's prefix-cache bookkeeping.

Freed blocks keep their hash and stay findable until the LRU free queue hands them out
again; only then are they evicted (a ``BlockRemoved``). Block 0 is vLLM's null block and is
never handed out, so usable capacity is ``num_gpu_blocks - 1``.

As vLLM 0.32's ``BlockPool.free_blocks``, a freed block without a hash (a partial tail,
decode tokens) goes to the *front* of the free queue and is reused first, and a cached one
to the back. Appending both at the back evicts cached blocks early, and the mock's cached
tokens then differ from vLLM's (``bench.mock_fidelity``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from switchyard.mock.engine.events import AllBlocksCleared, BlockRemoved, KVEvent


class Block:
    __slots__ = ("block_id", "ref_cnt", "digest", "published")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.published: int | bytes = 0


class BlockPool:
    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        # The free queue, first evicted first: ``front`` (freed blocks without a hash,
        # prepended), then blocks never used yet (vLLM's initial queue is in id order;
        # created lazily so a simulated fleet of thousands of engines stays small), then
        # ``free`` (freed cached blocks, appended).
        self.front: OrderedDict[int, Block] = OrderedDict()
        self.free: OrderedDict[int, Block] = OrderedDict()
        self._next_id = 1
        # digest -> {block_id: block}: identical blocks computed concurrently are all cached,
        # as vLLM does (block tables stay append-only).
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return len(self.front) + len(self.free) + self.num_gpu_blocks - self._next_id

    @property
    def usage(self) -> float:
        """Referenced blocks / usable blocks (the null block left out), as vLLM's
        ``kv_cache_usage_perc`` (0..1)."""
        return 1.0 - self.num_free / (self.num_gpu_blocks - 1)

    def lookup(self, digest: bytes) -> Block | None:
        found = self.cached.get(digest)
        if not found:
            return None
        return next(iter(found.values()))

    def touch(self, blocks: Iterable[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                queue = self.free if b.block_id in self.free else self.front
                del queue[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the front of the free queue, evicting cached ones."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out: list[Block] = []
        front = min(n, len(self.front))
        for _ in range(front):
            b = self.front.popitem(last=False)[1]
            if b.digest is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        fresh = min(n - front, self.num_gpu_blocks - self._next_id)
        if fresh:
            first = self._next_id
            self._next_id += fresh
            for i in range(first, first + fresh):
                b = Block(i)
                b.ref_cnt = 1
                out.append(b)
        popitem = self.free.popitem
        for _ in range(n - front - fresh):
            b = popitem(last=False)[1]
            if b.digest is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        digest = b.digest
        assert digest is not None
        same = self.cached.get(digest)
        if same is not None and same.pop(b.block_id, None) is not None:
            if not same:
                del self.cached[digest]
            self.events.append(BlockRemoved(block_hashes=[b.published]))
        b.digest = None

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in eviction order (first evicted first):
        those without a hash go to the front of the free queue, cached ones to its back."""
        free = self.free
        uncached: list[Block] = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.digest is None:
                    uncached.append(b)
                else:
                    free[b.block_id] = b
        front = self.front
        for b in reversed(uncached):
            front[b.block_id] = b
            front.move_to_end(b.block_id, last=False)

    def register(self, b: Block, digest: bytes, published: int | bytes) -> None:
        b.digest = digest
        b.published = published
        same = self.cached.get(digest)
        if same is None:
            self.cached[digest] = {b.block_id: b}
        else:
            same[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: refused while any
        block is in use, else one ``AllBlocksCleared``."""
        if self.num_free != self.num_gpu_blocks - 1:
            return False
        for b in self.free.values():
            b.digest = None
        self.cached.clear()
        self.events.append(AllBlocksCleared())
        return True
