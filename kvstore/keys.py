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
from collections.abc import Sequence

import xxhash

_h = xxhash.xxh3_64_intdigest
_ROOT_TAG = b"switchyard-kv-root"


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
    raw = array("I", token_ids[: n * block_size]).tobytes()
    step = block_size * 4
    keys: list[int] = []
    append = keys.append
    prev = parent
    for off in range(0, n * step, step):
        prev = _h(prev.to_bytes(8, "little") + raw[off : off + step], seed)
        append(prev)
    return keys


def block_keys(
    token_ids: Sequence[int], block_size: int, seed: int = 0, extra: str | None = None
) -> list[int]:
    """Chained keys of every full block of a token sequence (a partial tail has no key)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return chain_keys(root_key(seed, extra), token_ids, block_size, seed)
