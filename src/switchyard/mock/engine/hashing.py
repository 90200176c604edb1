"""Chained block hashes exactly as each real engine computes and publishes them.

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``, default algorithm
``sha256``): ``digest = sha256(pickle.dumps((parent_digest or NONE_HASH, tuple(tokens),
extra_keys), protocol=HIGHEST))`` with ``NONE_HASH = sha256(pickle.dumps("vllm-none-hash"))``
(the fixed seed recent vLLM uses for cryptographic hashes when PYTHONHASHSEED is unset);
``extra_keys`` holds the LoRA name and, on the first block only, the ``cache_salt``.
Published as ``int.from_bytes(digest, "big") & (2**64 - 1)`` (the last 8 bytes, uint64).

SGLang (``sglang/srt/mem_cache/utils.py``): ``digest = sha256(parent_digest + tokens as
4-byte little-endian uint32)``; published as the signed int64 of the first 8 bytes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from switchyard.mock.engine.config import HashFlavor

_MASK64 = (1 << 64) - 1
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=_PICKLE_PROTOCOL)).digest()


def vllm_block_digest(
    parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    payload = (parent or VLLM_NONE_HASH, tuple(tokens), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=_PICKLE_PROTOCOL)).digest()


def vllm_published(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & _MASK64


def sglang_block_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    hasher = hashlib.sha256()
    if parent:
        hasher.update(parent)
    hasher.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return hasher.digest()


def sglang_published(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class BlockHasher:
    """Hashes one request's full blocks, chained from the root, for one flavour."""

    __slots__ = ("flavor", "block_size", "int_hashes")

    def __init__(self, flavor: HashFlavor, block_size: int, int_hashes: bool = True) -> None:
        self.flavor = flavor
        self.block_size = block_size
        self.int_hashes = int_hashes

    def digest(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        first: bool,
    ) -> bytes:
        if self.flavor == "sglang":
            # SGLang keeps LoRA / salted requests under separate radix roots; we model that
            # by seeding the chain, so only these (rare) hashes are ours rather than SGLang's.
            if first and (lora_name or cache_salt):
                parent = hashlib.sha256(f"{lora_name or ''}\0{cache_salt or ''}".encode()).digest()
            return sglang_block_digest(parent, tokens)
        return vllm_block_digest(parent, tokens, self.extra_keys(lora_name, cache_salt, first))

    @staticmethod
    def extra_keys(
        lora_name: str | None, cache_salt: str | None, first: bool
    ) -> tuple[Any, ...] | None:
        """vLLM's per-block extra hash keys: the LoRA name, and the salt on block 0 only."""
        keys: list[Any] = []
        if lora_name:
            keys.append(lora_name)
        if first and cache_salt:
            keys.append(cache_salt)
        return tuple(keys) if keys else None

    def published(self, digest: bytes) -> int | bytes:
        if self.flavor == "sglang":
            return sglang_published(digest)
        return vllm_published(digest) if self.int_hashes else digest

    def chain(
        self,
        tokens: Sequence[int],
        start_block: int,
        parent: bytes | None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        end_block: int | None = None,
    ) -> list[bytes]:
        """Digests of the full blocks of ``tokens`` from ``start_block`` up to ``end_block``
        (default: the last full block)."""
        bs = self.block_size
        end = len(tokens) // bs if end_block is None else min(end_block, len(tokens) // bs)
        out: list[bytes] = []
        i = start_block
        if i == 0 and i < end:
            parent = self.digest(parent, tokens[:bs], lora_name, cache_salt, True)
            out.append(parent)
            i = 1
        if self.flavor == "vllm" and i < end:
            # The hot loop of long prompts, inlined: same bytes as ``vllm_block_digest``.
            sha, dumps, proto = hashlib.sha256, pickle.dumps, _PICKLE_PROTOCOL
            extra = self.extra_keys(lora_name, None, False)
            for k in range(i * bs, end * bs, bs):
                parent = sha(
                    dumps((parent or VLLM_NONE_HASH, tuple(tokens[k : k + bs]), extra), proto)
                ).digest()
                out.append(parent)
            return out
        for k in range(i, end):
            parent = self.digest(
                parent, tokens[k * bs : (k + 1) * bs], lora_name, cache_salt, False
            )
            out.append(parent)
        return out
