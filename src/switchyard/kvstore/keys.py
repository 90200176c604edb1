"""Our own chained 64-bit block keys over token ids.

Engines hash blocks their own way (vLLM: sha256/cbor or builtin hash with a random
seed per process; SGLang: truncated SHA-256), so the store never compares engine
hashes with ours: every key is recomputed here from token ids, which makes the keys
of a lookup and the keys of an engine's ``BlockStored`` comparable by construction.

key[i] = xxh3_64(key[i-1] as 8 bytes LE || token ids of block i as uint32 LE, seed)
key[-1] = root(seed, extra): LoRA name and cache salt are mixed in at the root, so they
change every key of the chain, exactly as they change the engine's KV.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_h = xxhash.xxh3_64_intdigest
_h128 = xxhash.xxh3_128_intdigest
_ROOT_TAG = b"switchyard-kv-root"
# KeyCache: blocks per cached segment, and the bound of the cache in bytes.
SEGMENT_BLOCKS = 8
KEY_CACHE_BYTES = 32 * 2**20


def key_extra(lora_name: str | None = None, cache_salt: str | None = None) -> str | None:
    """The ``extra`` string for a request's adapter and salt (None when neither is set)."""
    if not lora_name and not cache_salt:
        return None
    return f"lora={lora_name or ''}\x00salt={cache_salt or ''}"


def root_key(seed: int = 0, extra: str | None = None) -> int:
    """The parent of block 0: depends on the seed and on ``extra`` (LoRA, cache salt)."""
    data = _ROOT_TAG if extra is None else _ROOT_TAG + b"\x00" + extra.encode()
    return _h(data, seed)


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Keys of the full blocks of ``token_ids``, chained from ``parent``."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    raw = _raw(token_ids, n * block_size)
    keys: list[int] = []
    _chain_raw(keys, parent, raw, block_size * 4, seed)
    return keys


def _raw(token_ids: Sequence[int], count: int) -> bytes:
    """The first ``count`` ids as uint32 LE; ``fromlist`` takes less time than
    ``array(code, ids)``, and this is the larger part of keying."""
    out = array("I")
    out.fromlist(token_ids[:count] if isinstance(token_ids, list) else list(token_ids[:count]))
    return out.tobytes()


def _chain_raw(out: list[int], parent: int, raw: bytes, step: int, seed: int) -> None:
    """Append to ``out`` the keys of the ``step``-byte blocks of ``raw``, from ``parent``."""
    append = out.append
    prev = parent
    for off in range(0, len(raw) - step + 1, step):
        prev = _h(prev.to_bytes(8, "little") + raw[off : off + step], seed)
        append(prev)


def block_keys(
    token_ids: Sequence[int], block_size: int, seed: int = 0, extra: str | None = None
) -> list[int]:
    """Chained keys of every full block of a token sequence (a partial tail has no key)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return chain_keys(root_key(seed, extra), token_ids, block_size, seed)


class KeyCache:
    """Block keys of token prefixes seen before, so turn k+1 of a chat hashes only its new
    blocks: keying a long chat from scratch on every turn is the larger part of its lookup.

    Keys are cached per segment of ``segment_blocks`` blocks, under a 128-bit digest
    chained over the root, the block size and every segment's token ids before it: one
    digest call per segment finds the cached part of a prefix, then only the rest is keyed
    block by block. Least recently used segments go first, bounded in bytes. ``hits`` and
    ``misses`` count blocks.
    """

    # Measured with tracemalloc: a segment of 8 keys (tuple, ints, digest, dict slot).
    ENTRY_BYTES = 420

    def __init__(self, max_bytes: int = KEY_CACHE_BYTES, segment_blocks: int = SEGMENT_BLOCKS):
        if segment_blocks <= 0:
            raise ValueError("segment_blocks must be positive")
        self.segment_blocks = segment_blocks
        self.max_entries = max_bytes // (self.ENTRY_BYTES * segment_blocks // SEGMENT_BLOCKS)
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def block_keys(
        self, token_ids: Sequence[int], block_size: int, seed: int = 0, extra: str | None = None
    ) -> list[int]:
        """The same keys as ``block_keys``, from the cache where a prefix was keyed before."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        n = len(token_ids) // block_size
        if n == 0:
            return []
        root = root_key(seed, extra)
        raw = _raw(token_ids, n * block_size)
        step = block_size * 4
        seg = step * self.segment_blocks
        cache = self._d
        digest = _h128(root.to_bytes(8, "little") + block_size.to_bytes(4, "little"))
        keys: list[int] = []
        off = 0
        while off + seg <= len(raw):
            digest = _h128(digest.to_bytes(16, "little") + raw[off : off + seg])
            found = cache.get(digest)
            if found is None:
                break
            cache.move_to_end(digest)
            keys.extend(found)
            off += seg
        self.hits += len(keys)
        self.misses += n - len(keys)
        if off == len(raw):
            return keys
        first_new = len(keys)
        _chain_raw(keys, keys[-1] if keys else root, raw[off:], step, seed)
        # Cache the new full segments: ``digest`` already covers the first one.
        for start in range(first_new, n - self.segment_blocks + 1, self.segment_blocks):
            if start > first_new:
                at = start * step
                digest = _h128(digest.to_bytes(16, "little") + raw[at : at + seg])
            cache[digest] = tuple(keys[start : start + self.segment_blocks])
        while len(cache) > self.max_entries:
            cache.popitem(last=False)
        return keys
