"""The best fleet hit rate a router could reach on a workload, computed offline.

Model (an optimistic reference, not a proof of optimality): every request is placed
perfectly, as if the whole fleet were ONE engine whose prefix cache has the fleet's
total KV capacity, and requests run one at a time in arrival order. Hits follow the
engine's rules: only full blocks count and the last prompt token is always recomputed.
Two figures come out:

- ``infinite``: no eviction at all, the workload's pure reuse;
- ``bounded``: an LRU cache of ``engines × num_gpu_blocks`` blocks; a finished request's
  prompt blocks and its output blocks (never reused here) are freed tail first, as vLLM
  frees them, so the head of a prefix outlives its tail.

Real fleets fall short of ``bounded`` because a shared prefix used on several engines
is stored several times, and requests in flight hold blocks and race each other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from switchyard.loadtest.workload import Workload
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.mock.tokenizer import ModelTokenizer


@dataclass
class Ceiling:
    prompt_tokens: int
    infinite_hit_rate: float
    bounded_hit_rate: float
    capacity_blocks: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return dict(vars(self))


def prefix_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Process-local hash of each full block's whole prefix: equal hash = equal tokens up to
    that block's end. Only for the offline cache replay; routing keys are ``kvstore.keys``."""
    keys = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


def hit_tokens(
    prompts: Iterable[list[int]], outputs: list[int], block_size: int, capacity: int | None
) -> tuple[int, int]:
    """(cached, prompt) tokens over a sequence of prompts replayed through one LRU cache."""
    cache: OrderedDict[int, None] = OrderedDict()
    cached = total = 0
    unique = 0
    for tokens, out in zip(prompts, outputs, strict=True):
        keys = prefix_hashes(tokens, block_size)
        limit = (len(tokens) - 1) // block_size
        hit = 0
        while hit < limit and keys[hit] in cache:
            hit += 1
        cached += hit * block_size
        total += len(tokens)
        output_blocks = (len(tokens) % block_size + out) // block_size
        tail = []
        for _ in range(output_blocks):
            unique -= 1
            tail.append(unique)
        # Most recent last: output blocks, then the prompt from its tail to its head.
        for key in [*tail, *reversed(keys)]:
            cache[key] = None
            cache.move_to_end(key)
        if capacity is not None:
            while len(cache) > capacity:
                cache.popitem(last=False)
    return cached, total


def ceiling(
    workload: Workload,
    engines: int,
    num_gpu_blocks: int | None,
    block_size: int = EngineConfig.block_size,
    tokenizer_dir: str = DEFAULT_TOKENIZER,
) -> Ceiling:
    prompts = workload_prompts(workload, tokenizer_dir)
    outputs = [r.max_tokens for r in workload.requests]
    capacity = engines * num_gpu_blocks if num_gpu_blocks else None
    return ceiling_of(lambda: iter(prompts), outputs, block_size, capacity)


def workload_prompts(workload: Workload, tokenizer_dir: str = DEFAULT_TOKENIZER) -> list[list[int]]:
    """Each request's prompt token ids as a mock engine tokenizes it (its chat template)."""
    tok = ModelTokenizer(tokenizer_dir)
    raw = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    texts = [tok.render_chat(r.messages) for r in workload.requests]
    return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]


def ceiling_of(
    prompts: Callable[[], Iterable[list[int]]],
    outputs: list[int],
    block_size: int,
    capacity: int | None,
) -> Ceiling:
    """The ceiling of tokenized prompts; ``prompts`` is called once per pass, so a large
    workload can build them one at a time."""
    hit_inf, total = hit_tokens(prompts(), outputs, block_size, None)
    hit_cap = hit_tokens(prompts(), outputs, block_size, capacity)[0] if capacity else hit_inf
    return Ceiling(
        prompt_tokens=total,
        infinite_hit_rate=hit_inf / total if total else 0.0,
        bounded_hit_rate=hit_cap / total if total else 0.0,
        capacity_blocks=capacity,
    )
