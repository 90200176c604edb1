"""Engine-neutral KV cache events, one batch per engine step.

The shapes follow vLLM's ``vllm/distributed/kv_events.py`` (which SGLang copied), so the
publisher only has to choose an encoding. Hashes are already the *published* values
for the engine flavour (vLLM: uint64, or the 32-byte digest; SGLang: signed int64).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # vLLM: the extra hash keys of each block (LoRA name, cache salt), None when it has none.
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int | bytes]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
